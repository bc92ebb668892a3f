"""Engine formats derived from the same decisions: ragged, per-layer padded, uniform (TRT-LLM / SGLang).

TensorRT-LLM and SGLang keep one KV length per request for every head (and layer). The uniform format
gives each head its own kept set plus its best-scored evicted tokens, up to the request's maximum count
over heads (and over layers, when all layers are given), sorted ascending.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvzap_export.errors import InputError


class UniformSelection(NamedTuple):
    """indices int32 [..., B, H, K_max] ascending positions then -1; counts int32 [B] (K per request)."""

    indices: torch.Tensor
    counts: torch.Tensor


def uniform_selection(scores: torch.Tensor, keep: torch.Tensor, lengths: torch.Tensor,
                      counts: torch.Tensor | None = None) -> UniformSelection:
    """Per request, every head keeps ``K_b`` = max kept count over heads (and layers) tokens.

    scores, keep: (batch, kv_heads, seq) for one layer, or (layers, batch, kv_heads, seq) for all layers
    (then ``K_b`` is shared by every layer, as a slot/block table shared by layers requires).
    lengths: (batch,). Extra tokens are each head's best-scored evicted valid ones (ties: earlier first).
    counts: optional (batch,) ``K_b`` to use instead of the local maximum, e.g. agreed across
    tensor-parallel ranks that each hold some of the heads; each must lie in [local max, lengths[b]].
    """
    if scores.shape != keep.shape or scores.dim() not in (3, 4):
        raise InputError(f"scores and keep must share a [batch, heads, seq] or [layers, batch, heads, seq] shape, got "
                         f"{list(scores.shape)} and {list(keep.shape)}")
    squeeze = scores.dim() == 3
    if squeeze:
        scores, keep = scores[None], keep[None]
    seq = scores.shape[-1]
    pos = torch.arange(seq, device=scores.device)
    valid = pos < lengths.to(scores.device, torch.int64)[None, :, None, None]
    per_request = keep.sum(-1).amax(dim=(0, 2)).to(torch.int32)  # [B]
    if counts is not None:
        counts = counts.to(device=per_request.device, dtype=torch.int32).reshape(-1)
        limit = lengths.to(device=per_request.device, dtype=torch.int32).reshape(-1)
        if counts.shape != per_request.shape or bool((counts < per_request).any()) or bool((counts > limit).any()):
            raise InputError(f"counts must be [batch] with kept max <= counts <= lengths; got {counts.tolist()} for kept max "
                             f"{per_request.tolist()} and lengths {limit.tolist()}")
        per_request = counts
    # Kept first (their own set), then evicted valid tokens by descending score, padding last.
    priority = torch.where(keep, torch.inf, torch.where(valid, scores.float().nan_to_num(nan=torch.inf), -torch.inf))
    order = torch.sort(priority, dim=-1, descending=True, stable=True).indices
    k_max = int(per_request.max()) if per_request.numel() else 0
    chosen = order[..., :k_max]
    rank = torch.arange(k_max, device=scores.device)
    chosen = torch.where(rank < per_request.to(torch.int64)[None, :, None, None], chosen, seq)  # pad sorts last
    chosen = torch.sort(chosen, dim=-1).values
    indices = torch.where(chosen < seq, chosen, -1).to(torch.int32)
    return UniformSelection(indices[0] if squeeze else indices, per_request)


def trtllm_sparse_layout(selection: UniformSelection) -> tuple[torch.Tensor, torch.Tensor]:
    """TensorRT-LLM's sparse KV layout for one layer: (indices int32 [num_kv_heads, total], offsets int32 [B + 1]).

    Request b owns columns ``offsets[b]:offsets[b+1]`` (its K_b selected positions, ascending per head).
    """
    indices, counts = selection
    if indices.dim() != 3:
        raise InputError(f"trtllm_sparse_layout takes one layer's selection [batch, heads, K], got {list(indices.shape)}")
    parts = [indices[b, :, : int(counts[b])] for b in range(indices.shape[0])]
    heads = indices.shape[1]
    flat = torch.cat(parts, dim=1) if parts else torch.empty(heads, 0, dtype=torch.int32)
    offsets = torch.zeros(indices.shape[0] + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(counts.to(torch.int64), 0).to(torch.int32)
    return flat.to(torch.int32).contiguous(), offsets


def memory_report(counts: torch.Tensor, lengths: torch.Tensor) -> dict[str, float]:
    """KV entries held by each layout and the fraction each frees, from per-(layer, batch, head) counts.

    counts: int [layers, batch, kv_heads] (or [batch, kv_heads] for one layer); lengths: (batch,).
    """
    if counts.dim() == 2:
        counts = counts[None]
    layers, _, heads = counts.shape
    full = float(lengths.sum()) * heads * layers
    ragged = float(counts.sum())
    per_layer_padded = float(counts.amax(dim=2).sum()) * heads
    uniform = float(counts.amax(dim=(0, 2)).sum()) * heads * layers
    freed = (lambda held: 0.0 if full == 0 else 1.0 - held / full)
    return {
        "full_entries": full, "ragged_entries": ragged, "per_layer_padded_entries": per_layer_padded, "uniform_entries": uniform,
        "ragged_freed": freed(ragged), "per_layer_padded_freed": freed(per_layer_padded), "uniform_freed": freed(uniform),
    }
