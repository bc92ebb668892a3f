"""Triton kernels of threshold compaction: fused decisions (scores → keep / counts / indices) and the K/V move.

Semantics are the reference's (``kvzap_export.ops.compaction``), bit for bit:

- ``compaction_kernel``: one program per (sequence, KV head). It walks the sequence in blocks; per block it
  decides ``keep`` (valid and (protected or not score < τ)), takes the block-local inclusive prefix sum of
  ``keep`` and, with the running count of earlier blocks, writes each kept position to its slot of
  ``indices`` (kept positions ascending). A second pass fills the tail with -1; the final count is ``counts``.
  τ arrives as a float32 tensor (as in the ONNX node) and is rounded to the scores' dtype inside the kernel,
  then compared in float32 — exactly ``scores < τ`` in the scores' dtype, as kvpress compares.
- ``kv_move_kernel``: grid (sequence × head, token blocks); each program gathers ``BLOCK_T`` rows of
  ``head_dim`` from their source positions (``indices``) and writes them contiguously; rows without an
  index are written as zeros. Every output byte is written once and every kept input row read once.

The same ``compaction_kernel`` is launched from torch (``triton_threshold_compaction``) and compiled
ahead of time to PTX for TensorRT (``kvzap_export.kernels.trt_plugin``): its argument order is the QDP
AOT order (input tensors, scalar extras, output tensors).

Without a GPU, set ``TRITON_INTERPRET=1`` before this module is imported to run the kernels on the CPU
(slow; used by the tests).
"""

from __future__ import annotations

import torch

from kvzap_export.errors import MissingDependencyError
from kvzap_export.ops.compaction import Compaction, check_inputs, check_kv_inputs

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError:  # pragma: no cover - exercised where triton is absent
    triton = None

BLOCK_T = 1024  # tokens per step of the compaction kernel
MOVE_BLOCK_T = 16  # rows per program of the K/V move


def require_triton():
    if triton is None:
        raise MissingDependencyError("the Triton kernels need triton: pip install 'kvzap-export[gpu]'")
    return triton


if triton is not None:

    @triton.jit
    def compaction_kernel(scores_ptr, lengths_ptr, threshold_ptr, window_ptr, seq, heads,
                          keep_ptr, counts_ptr, indices_ptr, SINK: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # sequence * heads + head
        batch = row // heads
        base = row.to(tl.int64) * seq
        length = tl.load(lengths_ptr + batch).to(tl.int32)
        window = tl.load(window_ptr).to(tl.int32)
        # τ in the scores' dtype (kvpress compares there), then an exact float32 comparison.
        tau = tl.load(threshold_ptr).to(tl.float32)
        if scores_ptr.dtype.element_ty == tl.bfloat16:
            # Round to nearest even by hand: Triton's CPU interpreter truncates float32 -> bfloat16.
            bits = tau.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            tau = bits.to(tl.float32, bitcast=True)
        else:
            tau = tau.to(scores_ptr.dtype.element_ty).to(tl.float32)
        window_start = length - window
        count = tl.zeros((), dtype=tl.int32)
        for start in range(0, seq, BLOCK):
            pos = start + tl.arange(0, BLOCK)
            in_seq = pos < seq
            score = tl.load(scores_ptr + base + pos, mask=in_seq, other=0.0).to(tl.float32)
            valid = pos < length
            protected = (pos >= window_start) | (pos < SINK)
            below = score < tau  # False for NaN: NaN is kept
            keep = valid & (protected | (below == 0))
            keep_i = keep.to(tl.int32)
            tl.store(keep_ptr + base + pos, keep_i.to(tl.int8), mask=in_seq)
            slot = count + tl.cumsum(keep_i, axis=0) - 1
            tl.store(indices_ptr + base + slot, pos, mask=keep)
            count += tl.sum(keep_i, axis=0)
        tl.store(counts_ptr + row, count)
        for start in range(0, seq, BLOCK):
            pos = start + tl.arange(0, BLOCK)
            tl.store(indices_ptr + base + pos, tl.full((BLOCK,), -1, tl.int32), mask=(pos < seq) & (pos >= count))

    @triton.jit
    def kv_move_kernel(keys_ptr, values_ptr, indices_ptr, keys_out_ptr, values_out_ptr, seq, head_dim,
                       BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        row = tl.program_id(0)  # sequence * heads + head
        block = tl.program_id(1)
        t = block * BLOCK_T + tl.arange(0, BLOCK_T)
        d = tl.arange(0, BLOCK_D)
        in_seq = t < seq
        src = tl.load(indices_ptr + row.to(tl.int64) * seq + t, mask=in_seq, other=-1)
        has = src >= 0
        head_base = row.to(tl.int64) * seq * head_dim
        d_ok = d[None, :] < head_dim
        src_off = head_base + src.to(tl.int64)[:, None] * head_dim + d[None, :]
        dst_off = head_base + t.to(tl.int64)[:, None] * head_dim + d[None, :]
        load_mask = has[:, None] & d_ok
        store_mask = in_seq[:, None] & d_ok
        k = tl.load(keys_ptr + src_off, mask=load_mask, other=0.0)
        tl.store(keys_out_ptr + dst_off, k, mask=store_mask)
        v = tl.load(values_ptr + src_off, mask=load_mask, other=0.0)
        tl.store(values_out_ptr + dst_off, v, mask=store_mask)


def _scalar_tensors(threshold: float, window: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([threshold], dtype=torch.float32, device=device),
            torch.tensor([window], dtype=torch.int32, device=device))


def triton_threshold_compaction(scores: torch.Tensor, lengths: torch.Tensor, threshold, window, sink=0) -> Compaction:
    """The fused kernel; same contract and outputs as ``kvzap_export.ops.threshold_compaction``."""
    require_triton()
    tau, win, snk = check_inputs(scores, lengths, threshold, window, sink)
    scores = scores.contiguous()
    batch, heads, seq = scores.shape
    lengths = lengths.to(device=scores.device, dtype=torch.int32).contiguous()
    tau_t, win_t = _scalar_tensors(tau, win, scores.device)
    keep = torch.empty(batch, heads, seq, dtype=torch.int8, device=scores.device)
    counts = torch.empty(batch, heads, dtype=torch.int32, device=scores.device)
    indices = torch.empty(batch, heads, seq, dtype=torch.int32, device=scores.device)
    if scores.numel():
        compaction_kernel[(batch * heads,)](scores, lengths, tau_t, win_t, seq, heads, keep, counts, indices,
                                            SINK=snk, BLOCK=min(BLOCK_T, triton.next_power_of_2(seq)))
    else:
        counts.zero_()
    return Compaction(keep.view(torch.bool), counts, indices)


def triton_kv_compaction(keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V move kernel; same contract and outputs as ``kvzap_export.ops.kv_compaction``."""
    require_triton()
    check_kv_inputs(keys, values, indices)
    keys, values = keys.contiguous(), values.contiguous()
    indices = indices.to(device=keys.device, dtype=torch.int32).contiguous()
    batch, heads, seq, head_dim = keys.shape
    keys_out, values_out = torch.empty_like(keys), torch.empty_like(values)
    if keys.numel():
        grid = (batch * heads, triton.cdiv(seq, MOVE_BLOCK_T))
        kv_move_kernel[grid](keys, values, indices, keys_out, values_out, seq, head_dim,
                             BLOCK_T=MOVE_BLOCK_T, BLOCK_D=triton.next_power_of_2(head_dim))
    return keys_out, values_out
