"""Ragged decode attention through SGLang's own Triton decode kernel (``sglang_kernels``), every (request, KV head)
passed as one sequence: ``launch``, one call of the kernel over rows laid out by the caller (the engine's
``flattened_step.FlattenedStep``; the benchmark's ``bench.flattened_decode.FlattenedDecode``).

SGLang's ``decode_attention_fwd`` (page size 1) takes, per sequence, ``kv_indices[kv_indptr[s]:kv_indptr[s + 1]]``
(its entries) and splits the sequence over ``num_kv_splits[s]`` programs. Our layout (docs/ragged-kv.md) gives each
(request b, KV head h) its own entry ids, so row ``s = b * kv_heads + h`` is one sequence with ONE KV head and its
``group`` query heads: ``q`` viewed [B * kv_heads, group, D], K and V the one-head stores [E, D] viewed [E, 1, D]
(read in place, never copied). The query group goes through ``tl.dot`` inside SGLang's kernel.

What a caller lays out:

- ``kv_indptr`` int32 [rows + 1]: the running sum of the rows' lengths;
- ``kv_indices`` int64: each row's entry ids, at ``kv_indptr[s]``. int64 because SGLang's kernel computes the element
  offset ``id * row_stride`` in the dtype of ``kv_indices`` (int32 indices overflow once ``id * D`` passes 2**31:
  16.7M entries at D = 128, 8.4M with K and V in one [E, 2D] pool);
- ``num_kv_splits`` int32 [rows]: programs per row (SGLang's kernel rounds a split up to 32 entries, so splits past
  ``ceil(length / 32)`` do nothing);
- ``attn_logits`` float32 [rows, group, max_kv_splits, Dv], ``attn_lse`` float32 [rows, group, max_kv_splits]: the
  kernel's partial results; ``empty`` bool [rows]: the rows with no entry.

A head with no entry: SGLang's second stage divides 0 by 0 there (NaN); ``launch`` overwrites those rows with zeros
(one in-place masked fill), as the torch path of ``ragged_attention`` gives.
"""

from __future__ import annotations

import torch

from kvzap_export.errors import InputError


def launch(kernels, q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, scale: float, *, rows: int,
           kv_heads: int, group: int, head_dim: int, v_head_dim: int, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
           num_kv_splits: torch.Tensor, attn_logits: torch.Tensor, attn_lse: torch.Tensor, empty: torch.Tensor,
           spare_q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """One call of SGLang's decode kernel over ``rows`` flattened rows laid out in ``kv_indptr`` [rows + 1] (offsets
    into ``kv_indices``), ``num_kv_splits`` / ``empty`` [rows] and the partial-result buffers (at least ``rows``
    rows): q [B, kv_heads * group, D] (viewed when its strides allow, else copied into ``spare_q``), stores [E, D] /
    [E, Dv]; ``out`` [rows, group, Dv] or q's shape with Dv (contiguous). Returns [B, q_heads, Dv] (a view of out).
    A row with no entry gives zeros."""
    R, G = rows, group
    if q.dim() != 3 or k_store.dim() != 2 or v_store.dim() != 2 or k_store.shape[-1] != head_dim:
        raise InputError(f"flattened decode: q [B, q_heads, D], stores [E, D]; got {list(q.shape)}, "
                         f"{list(k_store.shape)}, {list(v_store.shape)}")
    B, Hq, D = q.shape
    if B * kv_heads != R or Hq != kv_heads * G or D != head_dim:
        raise InputError(f"flattened decode: q {list(q.shape)} does not match the filled {R} rows of "
                         f"{kv_heads} KV heads x group {G}, head dim {head_dim}")
    if k_store.stride(-1) != 1 or v_store.stride(-1) != 1 or v_store.shape[-1] != v_head_dim:
        raise InputError("flattened decode: store rows must be contiguous, values of the buffers' Dv")
    if q.stride(-1) == 1 and q.stride(0) == Hq * q.stride(1):  # the kernel takes any row/head strides
        q3 = q.as_strided((R, G, D), (G * q.stride(1), q.stride(1), 1))
    else:
        q3 = spare_q[:R]
        q3.view(B, Hq, D).copy_(q)
    o3 = out.view(R, G, v_head_dim)
    kernels.decode.decode_attention_fwd(
        q3, k_store.unsqueeze(1), v_store.unsqueeze(1), o3, kv_indptr, kv_indices, attn_logits[:R], attn_lse[:R],
        num_kv_splits, attn_logits.shape[2], float(scale), 1.0, 1.0)
    o3.masked_fill_(empty[:, None, None], 0)  # an empty row: SGLang's stage 2 wrote 0 / 0
    return o3.view(B, Hq, v_head_dim)
