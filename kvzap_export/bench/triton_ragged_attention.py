"""Our first Triton decode attention over per-head KV rows (the ragged layout, docs/ragged-kv.md), kept as the
benchmark's point of comparison: ``scripts/bench_ragged_decode.py`` times it beside SGLang's kernel (its
"triton-ragged (ours)" rows). No engine path runs it: on CUDA the engine runs SGLang's kernel
(``kernels/flattened_step.py``).

One program per (request, KV head): it walks that head's entry ids in blocks of ``BLOCK_N``, gathers the
K and V rows from the one-head entry pool, and keeps an online softmax (running max, running sum, running
weighted values) for each of the ``GROUP`` query heads that read this KV head. Accumulation is float32; the
output is written in the query's dtype. A head with no entry writes zeros (as the torch path).

Same contract as ``ragged_attention.ragged_decode_attention`` (the float32 formula); tests/kernels compare the
two under ``TRITON_INTERPRET=1``, with the stores as views of the combined pool the ragged mode keeps
(``kv[:, :D]``, ``kv[:, D:]``: rows read in place, never copied). One launch per layer for the whole batch.
This module imports without triton; the launcher then raises ``MissingDependencyError``.
"""

from __future__ import annotations

import torch

from kvzap_export.errors import MissingDependencyError
from kvzap_export.kernels.ragged_shapes import query_group

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError:  # pragma: no cover - exercised where triton is absent
    triton = None

BLOCK_N = 64


if triton is not None:

    @triton.jit
    def ragged_decode_kernel(q_ptr, k_ptr, v_ptr, ids_ptr, len_ptr, out_ptr, scale,
                             stride_qb, stride_qh, stride_kn, stride_vn, stride_ib, stride_ih, stride_ob, stride_oh,
                             H: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, D: tl.constexpr,
                             DV: tl.constexpr, D_P2: tl.constexpr, DV_P2: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        g = tl.arange(0, GROUP_P2)
        d = tl.arange(0, D_P2)
        dv = tl.arange(0, DV_P2)
        g_ok = g < GROUP
        q_rows = q_ptr + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh + d[None, :]
        q = tl.load(q_rows, mask=g_ok[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)  # [G, D]
        n = tl.load(len_ptr + b * H + h)
        m = tl.full((GROUP_P2,), float("-inf"), tl.float32)
        s = tl.zeros((GROUP_P2,), tl.float32)
        acc = tl.zeros((GROUP_P2, DV_P2), tl.float32)
        for start in range(0, n, BLOCK):
            j = start + tl.arange(0, BLOCK)
            ok = j < n
            entry = tl.load(ids_ptr + b * stride_ib + h * stride_ih + j, mask=ok, other=0).to(tl.int64)
            k = tl.load(k_ptr + entry[:, None] * stride_kn + d[None, :], mask=ok[:, None] & (d[None, :] < D),
                        other=0.0).to(tl.float32)  # [BLOCK, D]
            v = tl.load(v_ptr + entry[:, None] * stride_vn + dv[None, :], mask=ok[:, None] & (dv[None, :] < DV),
                        other=0.0).to(tl.float32)  # [BLOCK, DV]
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, BLOCK]
            scores = tl.where(ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            s = s * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        out = tl.where(s[:, None] > 0, acc / tl.where(s[:, None] > 0, s[:, None], 1.0), 0.0)
        o_rows = out_ptr + b * stride_ob + (h * GROUP + g)[:, None] * stride_oh + dv[None, :]
        tl.store(o_rows, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & (dv[None, :] < DV))


def ragged_decode_attention_triton(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, ids: torch.Tensor,
                                   lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, q_heads, D]; k_store: [E, D]; v_store: [E, Dv]; ids: int [B, kv_heads, n]; lengths: int [B, kv_heads].
    Returns [B, q_heads, Dv] in q's dtype."""
    if triton is None:
        raise MissingDependencyError("the ragged attention kernel needs triton: pip install 'kvzap-export[gpu]'")
    group = query_group(q, k_store, v_store, ids)
    B, Hq, D = q.shape
    H = ids.shape[1]
    DV = v_store.shape[-1]
    q = q.contiguous()
    # The stores are read in place (rows may be views of one combined [E, D + Dv] pool): only each row's
    # elements must be contiguous, never the pool copied.
    k_store = k_store if k_store.stride(-1) == 1 else k_store.contiguous()
    v_store = v_store if v_store.stride(-1) == 1 else v_store.contiguous()
    ids = ids.contiguous()
    lengths = lengths.to(torch.int32).contiguous()
    out = torch.empty(B, Hq, DV, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    ragged_decode_kernel[(B, H)](
        q, k_store, v_store, ids, lengths, out, float(scale),
        q.stride(0), q.stride(1), k_store.stride(0), v_store.stride(0), ids.stride(0), ids.stride(1),
        out.stride(0), out.stride(1),
        H=H, GROUP=group, GROUP_P2=triton.next_power_of_2(group), D=D, DV=DV, D_P2=triton.next_power_of_2(D),
        DV_P2=triton.next_power_of_2(DV), BLOCK=BLOCK_N)
    return out
