"""Attention over per-head KV rows (the ragged layout of docs/ragged-kv.md), plain torch.

K and V live in one pool of one-head entries (``k_store``, ``v_store``: ``[E, D]``); each KV head of each
request has its own row of entry ids. Query head ``q`` reads KV head ``q // group`` (grouped-query attention
stays exact). Computed in float32, returned in the query's dtype. A head with no entry gives zeros.

- ``ragged_decode_attention``: one query token per request, a batch of requests (vectorized);
- ``ragged_extend_attention``: the query tokens of one request's prompt chunk, causal by logical positions.

``triton_ragged_attention.ragged_decode_attention_triton`` is the GPU decode kernel; ``decode_attention``
picks it on CUDA tensors (when Triton is present) and this path otherwise.
"""

from __future__ import annotations

import torch

from kvzap_export.errors import InputError


def _check(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, ids: torch.Tensor) -> int:
    if q.dim() != 3 or k_store.dim() != 2 or v_store.dim() != 2 or k_store.shape[0] != v_store.shape[0]:
        raise InputError(f"ragged attention: q [tokens, q_heads, D], stores [E, D]; got {list(q.shape)}, "
                         f"{list(k_store.shape)}, {list(v_store.shape)}")
    if q.shape[-1] != k_store.shape[-1]:
        raise InputError(f"ragged attention: query head dim {q.shape[-1]} != key head dim {k_store.shape[-1]}")
    heads = ids.shape[-2]
    if q.shape[1] % heads:
        raise InputError(f"ragged attention: {q.shape[1]} query heads do not group over {heads} KV heads")
    return q.shape[1] // heads


def _attend(scores: torch.Tensor, mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """softmax over the last axis of ``scores`` where ``mask`` (zeros where a row has nothing), times values."""
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an all-masked row: softmax is NaN -> 0
    return weights @ values


def ragged_decode_attention(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, ids: torch.Tensor,
                            lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, q_heads, D]; ids: int [B, kv_heads, n] (entries past ``lengths[b, h]`` are ignored);
    lengths: int [B, kv_heads]. Returns [B, q_heads, Dv]."""
    group = _check(q, k_store, v_store, ids)
    B, Hq, D = q.shape
    H, n = ids.shape[1], ids.shape[2]
    safe = ids.clamp(min=0).to(torch.int64)
    keys = k_store[safe].float()  # [B, H, n, D]
    values = v_store[safe].float()
    mask = torch.arange(n, device=ids.device) < lengths.to(ids.device)[..., None]  # [B, H, n]
    qg = q.float().view(B, H, group, D)
    scores = qg @ keys.transpose(-1, -2) * scale  # [B, H, group, n]
    out = _attend(scores, mask[:, :, None, :], values)  # [B, H, group, Dv]
    return out.reshape(B, Hq, -1).to(q.dtype)


def ragged_extend_attention(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, ids: torch.Tensor,
                            positions: torch.Tensor, lengths: torch.Tensor, q_positions: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """One request: q [T, q_heads, D] at logical positions ``q_positions`` [T]; ids, positions: int
    [kv_heads, n]; lengths: int [kv_heads]. Entry j of head h is seen by query t when
    ``j < lengths[h]`` and ``positions[h, j] <= q_positions[t]``. Returns [T, q_heads, Dv]."""
    group = _check(q, k_store, v_store, ids)
    T, Hq, D = q.shape
    H, n = ids.shape
    safe = ids.clamp(min=0).to(torch.int64)
    keys, values = k_store[safe].float(), v_store[safe].float()  # [H, n, D]
    held = torch.arange(n, device=ids.device) < lengths.to(ids.device)[:, None]  # [H, n]
    causal = positions.to(ids.device)[:, None, :] <= q_positions.to(ids.device)[None, :, None]  # [H, T, n]
    mask = (held[:, None, :] & causal)[:, None]  # [H, 1, T, n]
    qg = q.float().view(T, H, group, D).permute(1, 2, 0, 3)  # [H, group, T, D]
    scores = qg @ keys[:, None].transpose(-1, -2) * scale  # [H, group, T, n]
    out = _attend(scores, mask, values[:, None])  # [H, group, T, Dv]
    return out.permute(2, 0, 1, 3).reshape(T, Hq, -1).to(q.dtype)


def decode_attention(q, k_store, v_store, ids, lengths, scale) -> torch.Tensor:
    """``ragged_decode_attention`` on the CPU; the Triton kernel for CUDA tensors when Triton is installed."""
    if q.is_cuda:
        from kvzap_export.kernels import triton_ragged_attention as tr

        if tr.triton is not None:
            return tr.ragged_decode_attention_triton(q, k_store, v_store, ids, lengths, scale)
    return ragged_decode_attention(q, k_store, v_store, ids, lengths, scale)
