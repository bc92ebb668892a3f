"""The shape contract every ragged attention path checks (the torch paths of ``ragged_attention``, and the
benchmark's kernels ``bench.flattened_decode`` and ``bench.triton_ragged_attention``): queries [tokens, q_heads, D],
one-head entry stores [E, D] and [E, Dv], entry ids [..., kv_heads, n]. Kept apart so that each imports it and none
imports another for it."""

from __future__ import annotations

import torch

from kvzap_export.errors import InputError


def query_group(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, ids: torch.Tensor) -> int:
    """How many query heads read each KV head (grouped-query attention); InputError naming the shapes when the
    inputs do not fit together."""
    if q.dim() != 3 or k_store.dim() != 2 or v_store.dim() != 2 or k_store.shape[0] != v_store.shape[0]:
        raise InputError(f"ragged attention: q [tokens, q_heads, D], stores [E, D]; got {list(q.shape)}, "
                         f"{list(k_store.shape)}, {list(v_store.shape)}")
    if q.shape[-1] != k_store.shape[-1]:
        raise InputError(f"ragged attention: query head dim {q.shape[-1]} != key head dim {k_store.shape[-1]}")
    heads = ids.shape[-2]
    if q.shape[1] % heads:
        raise InputError(f"ragged attention: {q.shape[1]} query heads do not group over {heads} KV heads")
    return q.shape[1] // heads
