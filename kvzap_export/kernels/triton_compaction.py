"""Triton kernels of threshold compaction: fused decisions (scores → keep / counts / indices) and the K/V move.

Semantics are the reference's (``kvzap_export.ops.compaction``), bit for bit:

- ``compaction_kernel`` / ``compaction_kernel_scalars``: one program per (sequence, KV head) and chunk of
  ``CHUNK`` tokens — for sequences up to ``CHUNK_T`` (8192) tokens that is one program per (sequence, KV head);
  longer rows are split so that a single long sequence still fills the GPU. A program first counts the kept
  tokens of the earlier chunks of its row (decisions only, no writes), then walks its own chunk in blocks of
  ``BLOCK`` tokens (the next block's scores are loaded before the current one is processed): per block it
  decides ``keep`` (valid and (protected or not score < τ)), takes the block-local inclusive prefix sum of
  ``keep`` (``tl.cumsum``) and, offset by the running count, scatters each kept position to its slot of
  ``indices`` (kept positions ascending). The row's last chunk then knows the count: it writes ``counts`` and
  -1 into the free slots. All writes of all programs go to disjoint addresses: no barrier, no atomics, no
  workspace, deterministic. The price is re-reading earlier chunks' scores (2 bytes a token in bf16, about
  chunks/2 times), cheap next to the 5+ bytes a token the outputs write.
- τ is rounded to the scores' dtype first (float32 → bfloat16/float16, round to nearest even), then the
  comparison is made in float32, which is exact: this is what torch does for ``scores < python_float``
  (the Python float goes double → float32 → scores dtype; tests/kernels checks this claim on torch itself).
- ``kv_move_kernel``: a 1-D grid over (sequence × head, blocks of ``ROWS`` rows). Each program reads ``ROWS``
  indices, gathers those rows of ``head_dim`` (one contiguous, vectorizable row each: ``HEAD_DIM`` is a
  compile-time constant) and writes them contiguously; rows without an index are written as zeros. Every
  output byte is written once, every kept input row read once, evicted rows never read.

``compaction_kernel`` takes τ and ``window`` from device memory and its arguments are in the TensorRT QDP
AOT order (input tensors, scalar extras, output tensors): ``kvzap_export.kernels.trt_plugin`` compiles it to
PTX. ``compaction_kernel_scalars`` takes them as launch arguments (no host→device copy, so the torch path
can be captured in a CUDA graph); both inline the same ``_compact_chunk``.

Without a GPU, set ``TRITON_INTERPRET=1`` before this module is imported to run the kernels on the CPU
(slow; used by the tests). This module imports without triton; its functions then raise
``MissingDependencyError``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvzap_export.errors import InputError, MissingDependencyError
from kvzap_export.ops.compaction import Compaction, check_inputs, check_kv_inputs

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError:  # pragma: no cover - exercised where triton is absent
    triton = None

BLOCK_T = 2048  # tokens per step of the compaction kernel
CHUNK_T = 8192  # tokens per program: a row longer than this is split over several programs
COMPACTION_WARPS = 8
MOVE_TILE_BYTES = 16384  # bytes of one tensor moved per program of the K/V move
MOVE_MAX_ROWS = 128
MOVE_WARPS = 4


def require_triton():
    """The triton module, or a one-line ``MissingDependencyError`` saying how to install it."""
    if triton is None:
        raise MissingDependencyError("the Triton kernels need triton: pip install 'kvzap-export[gpu]' (triton>=3.2)")
    return triton


if triton is not None:

    @triton.jit
    def tau_in_dtype(tau, DTYPE: tl.constexpr):
        """τ (float32) rounded to the scores' dtype, returned as float32 (exact)."""
        if DTYPE == tl.bfloat16:
            # Round to nearest even on the bits, as torch's float -> bfloat16; Triton's CPU interpreter
            # truncates in .to(tl.bfloat16). τ is never NaN (rejected by check_inputs / finite in ONNX).
            bits = tau.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            tau = bits.to(tl.float32, bitcast=True)
        elif DTYPE == tl.float16:
            tau = tau.to(tl.float16).to(tl.float32)
        return tau

    @triton.jit
    def widen_scores(x, DTYPE: tl.constexpr):
        """Scores as float32, exactly: bfloat16 widened on the bits (the CPU interpreter's bfloat16 -> float32
        conversion flushes subnormals; on a GPU this shift is what the conversion instruction does)."""
        if DTYPE == tl.bfloat16:
            return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        return x.to(tl.float32)

    @triton.jit
    def _keep(score, pos, length, window_start, tau, SINK: tl.constexpr, DTYPE: tl.constexpr):
        """The decision rule for one block: valid and (protected or not score < τ); NaN is kept."""
        valid = pos < length
        protected = (pos >= window_start) | (pos < SINK)
        below = widen_scores(score, DTYPE) < tau  # False for NaN
        return valid & (protected | (below == 0))

    @triton.jit
    def _compact_chunk(scores_ptr, keep_ptr, counts_ptr, indices_ptr, pid, seq, heads, length_ptr_row, window, tau,
                       SINK: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
        """Program ``pid`` handles chunk ``pid % chunks`` of row ``pid // chunks`` (row = sequence * heads + head)."""
        DTYPE: tl.constexpr = scores_ptr.dtype.element_ty
        chunks = tl.maximum(tl.cdiv(seq, CHUNK), 1)
        row = pid // chunks
        chunk = pid % chunks
        length = tl.load(length_ptr_row + row // heads).to(tl.int32)
        base = row.to(tl.int64) * seq
        tau = tau_in_dtype(tl.cast(tau, tl.float32), DTYPE)
        window_start = length - window  # window <= 2^24 and 0 <= length <= seq: no int32 overflow
        offs = tl.arange(0, BLOCK)
        chunk_start = chunk * CHUNK
        # Kept tokens of the earlier chunks: only counted (CHUNK is a multiple of BLOCK, so no mask is needed).
        count = tl.zeros((), dtype=tl.int32)
        for start in range(0, chunk_start, BLOCK):
            pos = start + offs
            score = tl.load(scores_ptr + base + pos)
            count += tl.sum(_keep(score, pos, length, window_start, tau, SINK, DTYPE).to(tl.int32), axis=0)
        # This chunk: decide, then scatter kept positions to their slots (block-local prefix sum + running count).
        chunk_end = tl.minimum(chunk_start + CHUNK, seq)
        score = tl.load(scores_ptr + base + chunk_start + offs, mask=chunk_start + offs < chunk_end, other=0.0)
        for start in range(chunk_start, chunk_end, BLOCK):
            pos = start + offs
            ahead = pos + BLOCK
            upcoming = tl.load(scores_ptr + base + ahead, mask=ahead < chunk_end, other=0.0)  # prefetch
            keep = _keep(score, pos, length, window_start, tau, SINK, DTYPE)
            keep_i = keep.to(tl.int32)
            tl.store(keep_ptr + base + pos, keep_i.to(tl.int8), mask=pos < chunk_end)
            slot = count + tl.cumsum(keep_i, axis=0) - 1
            tl.store(indices_ptr + base + slot, pos, mask=keep)
            count += tl.sum(keep_i, axis=0)
            score = upcoming
        # The last chunk knows the row's count: it writes counts and -1 into the free slots (disjoint from the
        # slots any chunk scattered to, so no ordering between programs is needed).
        if chunk == chunks - 1:
            tl.store(counts_ptr + row, count)
            for start in range((count // BLOCK) * BLOCK, seq, BLOCK):
                pos = start + offs
                tl.store(indices_ptr + base + pos, tl.full((BLOCK,), -1, tl.int32), mask=(pos < seq) & (pos >= count))

    @triton.jit
    def compaction_kernel(scores_ptr, lengths_ptr, threshold_ptr, window_ptr, seq, heads,
                          keep_ptr, counts_ptr, indices_ptr, SINK: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
        """Grid (batch * heads * max(cdiv(seq, CHUNK), 1),). τ float32[] and window int32[] in device memory
        (the TensorRT / ONNX inputs)."""
        window = tl.load(window_ptr).to(tl.int32)
        tau = tl.load(threshold_ptr).to(tl.float32)
        _compact_chunk(scores_ptr, keep_ptr, counts_ptr, indices_ptr, tl.program_id(0), seq, heads, lengths_ptr,
                       window, tau, SINK, BLOCK, CHUNK)

    @triton.jit(do_not_specialize=["window", "heads"])
    def compaction_kernel_scalars(scores_ptr, lengths_ptr, threshold, window, seq, heads,
                                  keep_ptr, counts_ptr, indices_ptr, SINK: tl.constexpr, BLOCK: tl.constexpr,
                                  CHUNK: tl.constexpr):
        """Grid (batch * heads * max(cdiv(seq, CHUNK), 1),). τ (float32) and window (int32) as launch arguments."""
        _compact_chunk(scores_ptr, keep_ptr, counts_ptr, indices_ptr, tl.program_id(0), seq, heads, lengths_ptr,
                       window, threshold, SINK, BLOCK, CHUNK)

    @triton.jit
    def kv_move_kernel(keys_ptr, values_ptr, indices_ptr, keys_out_ptr, values_out_ptr, seq, blocks_per_row,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
        """1-D grid (batch * heads * blocks_per_row,): ``ROWS`` output rows of one (sequence, head) each."""
        pid = tl.program_id(0)
        row = pid // blocks_per_row
        t = (pid % blocks_per_row) * ROWS + tl.arange(0, ROWS)
        in_seq = t < seq
        src = tl.load(indices_ptr + row.to(tl.int64) * seq + t, mask=in_seq, other=-1)
        has = (src >= 0) & (src < seq)  # out-of-range indices read nothing (memory safety)
        d = tl.arange(0, BLOCK_D)
        d_ok = d[None, :] < HEAD_DIM
        head_base = row.to(tl.int64) * seq * HEAD_DIM
        src_off = head_base + src.to(tl.int64)[:, None] * HEAD_DIM + d[None, :]
        dst_off = head_base + t.to(tl.int64)[:, None] * HEAD_DIM + d[None, :]
        load_mask = has[:, None] & d_ok
        store_mask = in_seq[:, None] & d_ok
        k = tl.load(keys_ptr + src_off, mask=load_mask, other=0.0)
        v = tl.load(values_ptr + src_off, mask=load_mask, other=0.0)
        tl.store(keys_out_ptr + dst_off, k, mask=store_mask)
        tl.store(values_out_ptr + dst_off, v, mask=store_mask)


def _check_device(t: torch.Tensor) -> None:
    """Compiled kernels take CUDA tensors; interpreted ones (TRITON_INTERPRET=1) take CPU tensors."""
    interpreted = not isinstance(compaction_kernel_scalars, triton.runtime.JITFunction)
    if t.device.type != ("cpu" if interpreted else "cuda"):
        raise InputError(f"the Triton kernels need CUDA tensors, got {t.device}; on the CPU use kvzap_export.ops "
                         "or kvzap_export.kernels.torch_ops (which fall back to the reference)"
                         if not interpreted else f"the Triton interpreter (TRITON_INTERPRET=1) needs CPU tensors, got {t.device}")


class CompactionConfig(NamedTuple):
    """Tile sizes of the compaction kernel: tokens per step, tokens per program (a multiple of block), warps."""

    block: int
    chunk: int
    num_warps: int

    def programs(self, batch: int, heads: int, seq: int) -> int:
        return batch * heads * max(triton.cdiv(seq, self.chunk), 1)


def compaction_config(seq: int, block: int | None = None, chunk: int | None = None) -> CompactionConfig:
    """The compaction kernel's tiles for a sequence length (``block`` / ``chunk`` override the defaults)."""
    block = block or min(BLOCK_T, triton.next_power_of_2(max(seq, 16)))
    chunk = max(chunk or CHUNK_T, block)
    if chunk % block:
        raise ValueError(f"chunk ({chunk}) must be a multiple of block ({block}); use powers of two")
    return CompactionConfig(block, chunk, COMPACTION_WARPS if block >= 2048 else 4)


def launch_threshold_compaction(scores: torch.Tensor, lengths: torch.Tensor, threshold: float, window: int,
                                sink: int = 0, *, block: int | None = None, chunk: int | None = None) -> Compaction:
    """The fused kernel without validation or host synchronization (callers validate; see ``check_inputs``).

    scores: (batch, kv_heads, seq) float32/float16/bfloat16 on the kernel's device; lengths: (batch,) integer
    tensor; threshold: float; window, sink: int. Memory-safe for any lengths. ``block`` (tokens per step) and
    ``chunk`` (tokens per program) override the tiles; tests use small ones to cross boundaries cheaply.
    """
    require_triton()
    _check_device(scores)
    scores = scores.contiguous()
    batch, heads, seq = scores.shape
    lengths = lengths.to(device=scores.device).contiguous()
    keep = torch.empty(batch, heads, seq, dtype=torch.bool, device=scores.device)
    counts = torch.empty(batch, heads, dtype=torch.int32, device=scores.device)
    indices = torch.empty(batch, heads, seq, dtype=torch.int32, device=scores.device)
    if batch * heads == 0:
        return Compaction(keep, counts, indices)
    config = compaction_config(seq, block, chunk)
    compaction_kernel_scalars[(config.programs(batch, heads, seq),)](
        scores, lengths, float(threshold), int(window), seq, heads, keep.view(torch.int8), counts, indices,
        SINK=int(sink), BLOCK=config.block, CHUNK=config.chunk, num_warps=config.num_warps)
    return Compaction(keep, counts, indices)


def triton_threshold_compaction(scores: torch.Tensor, lengths: torch.Tensor, threshold, window, sink=0) -> Compaction:
    """The fused kernel; same contract, errors and outputs as ``kvzap_export.ops.threshold_compaction``.

    scores: (batch, kv_heads, seq) float; lengths: (batch,) int. Returns keep bool (batch, kv_heads, seq),
    counts int32 (batch, kv_heads), indices int32 (batch, kv_heads, seq).
    """
    require_triton()
    tau, win, snk = check_inputs(scores, lengths, threshold, window, sink)
    return launch_threshold_compaction(scores, lengths, tau, win, snk)


def move_rows_per_program(head_dim: int, element_size: int) -> int:
    """Rows of one tensor per K/V-move program: about ``MOVE_TILE_BYTES`` per tensor, a power of two."""
    row_bytes = triton.next_power_of_2(head_dim) * element_size
    return max(1, min(MOVE_MAX_ROWS, triton.next_power_of_2(max(1, MOVE_TILE_BYTES // row_bytes))))


def launch_kv_compaction(keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, *,
                         rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V move without validation (callers validate with ``check_kv_inputs``).

    keys, values: (batch, kv_heads, seq, head_dim) on one device; indices: (batch, kv_heads, seq)
    integer, -1 = none. ``rows`` overrides the rows per program (a power of two).
    """
    require_triton()
    _check_device(keys)
    if values.device != keys.device:
        raise InputError(f"keys and values must be on one device, got {keys.device} and {values.device}")
    keys, values = keys.contiguous(), values.contiguous()
    indices = indices.to(device=keys.device).contiguous()
    batch, heads, seq, head_dim = keys.shape
    keys_out, values_out = torch.empty_like(keys), torch.empty_like(values)
    if keys.numel():
        rows = rows or move_rows_per_program(head_dim, keys.element_size())
        blocks_per_row = triton.cdiv(seq, rows)
        kv_move_kernel[(batch * heads * blocks_per_row,)](
            keys, values, indices, keys_out, values_out, seq, blocks_per_row,
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), ROWS=rows, num_warps=MOVE_WARPS)
    return keys_out, values_out


def triton_kv_compaction(keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V move kernel; same contract and outputs as ``kvzap_export.ops.kv_compaction``.

    keys, values: (batch, kv_heads, seq, head_dim); indices: (batch, kv_heads, seq) int, -1 = none.
    Returns (keys_out, values_out): each head's kept entries first, in order, then zeros.
    """
    require_triton()
    check_kv_inputs(keys, values, indices)
    return launch_kv_compaction(keys, values, indices)
