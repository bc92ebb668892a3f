"""The decision a decode step makes per (request, KV head) row (kvpress ``decoding=True``): the one entry that
left the recent window this step is tested against τ and, if evicted, taken out of the row.

Per row ``r`` of entry ids (``ids[r, :lengths[r]]``, ascending logical positions, the last ``window`` of them inside
the window): when ``leaving[r]`` is set (a token left the window this step and it is not a protected ``sink``
position) the candidate is the entry at column ``c = lengths[r] - window - 1``; if its stored score is below τ
(strict ``<`` in the scores' dtype, so NaN is kept) the window's columns ``c + 1 ... lengths[r] - 1`` move one
column left, ``lengths[r]`` drops by one and ``freed[r]`` is the candidate's id; otherwise ``freed[r] = -1``.
Rows shorter than ``window + 1`` are left alone.

- ``decide_leaving``: the torch formula (any device; the CPU path, and the reference of the kernel);
- ``launch_decide_leaving``: one Triton program per row, in place (a barrier between the row's loads and its
  stores: the shift overlaps itself), no host sync, no allocation given ``freed``: what an engine captures in its
  decode CUDA graph. Under ``TRITON_INTERPRET=1`` it runs on CPU tensors (tests).

What a decision frees goes back to a free stack on the device, and the next step's entry ids come from it, inside
the same graph: ``recycle`` (the torch formula) and ``launch_recycle`` (one Triton program) push the freed ids
(``freed[r] >= 0``) in row order on ``free[:top]`` and pop ``fresh.numel()`` ids from the new top
(``fresh[i] = free[top' - n + i]``). ``free`` has one spare element past its capacity, which the formula writes for
rows that freed nothing; the caller keeps at least ``n`` ids on the stack.
"""

from __future__ import annotations

import torch

from kvzap_export.errors import InputError

try:
    import triton
    import triton.language as tl

    from kvzap_export.kernels.triton_compaction import tau_in_dtype, widen_scores  # τ and scores as the compaction compares
except ModuleNotFoundError:  # pragma: no cover - exercised where triton is absent
    triton = None


def _check(scores: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor, leaving: torch.Tensor, window: int) -> None:
    if ids.dim() != 2 or lengths.shape != ids.shape[:1] or leaving.shape != ids.shape[:1] or scores.dim() != 1:
        raise InputError(f"decode decision: ids [rows, width], lengths and leaving [rows], scores [entries]; got "
                         f"{list(ids.shape)}, {list(lengths.shape)}, {list(leaving.shape)}, {list(scores.shape)}")
    if window < 0:
        raise InputError(f"decode decision: window must be >= 0, got {window}")


def decide_leaving(scores: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor, leaving: torch.Tensor,
                   threshold: float, window: int) -> torch.Tensor:
    """In place on ``ids`` and ``lengths``; returns ``freed`` int32 [rows] (-1: nothing freed). The torch formula."""
    _check(scores, ids, lengths, leaving, window)
    rows, width = ids.shape
    length = lengths.to(torch.int64)
    column = length - window - 1
    ready = leaving.bool() & (column >= 0)
    candidate = ids.gather(1, column.clamp(min=0)[:, None])[:, 0].to(torch.int64)
    candidate = torch.where(ready, candidate, 0)  # a row not deciding may hold any padding id: never index with it
    evict = ready & (scores[candidate] < threshold)
    cols = torch.arange(width, device=ids.device)
    moving = evict[:, None] & (cols >= column[:, None]) & (cols < length[:, None] - 1)
    shifted = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
    ids.copy_(torch.where(moving, shifted, ids))
    lengths.sub_(evict.to(lengths.dtype))
    return torch.where(evict, candidate, -1).to(torch.int32)


def recycle(freed: torch.Tensor, free: torch.Tensor, top: torch.Tensor, fresh: torch.Tensor) -> None:
    """The torch formula of the free stack's push and pop (module docstring): freed int32 [rows], free int32
    [capacity + 1], top int64 [1], fresh int32 (any shape); all in place, no host read."""
    gone = freed >= 0
    where = torch.where(gone, top + torch.cumsum(gone, 0) - 1, free.shape[0] - 1)  # the spare element: nothing freed
    free.index_put_((where,), freed.to(free.dtype))
    top.add_(gone.sum())
    n = fresh.numel()
    fresh.view(-1).copy_(free[top - n + torch.arange(n, device=top.device)])
    top.sub_(n)


if triton is not None:

    @triton.jit
    def _recycle_kernel(freed_ptr, free_ptr, top_ptr, fresh_ptr, rows, n_fresh, ROWS: tl.constexpr,
                        FRESH: tl.constexpr):
        offs = tl.arange(0, ROWS)
        freed = tl.load(freed_ptr + offs, mask=offs < rows, other=-1)
        gone = freed >= 0
        top = tl.load(top_ptr)
        rank = tl.cumsum(gone.to(tl.int32), 0) - 1  # a freed id's place above the old top, in row order
        tl.store(free_ptr + top + rank, freed, mask=gone)
        new_top = top + tl.sum(gone.to(tl.int32), 0) - n_fresh
        tl.debug_barrier()  # every push stored before any thread pops (a pop may read a pushed id); one block: on
        # NVIDIA GPUs bar.sync orders its threads' global stores and loads (not checked on ROCm)
        f = tl.arange(0, FRESH)
        tl.store(fresh_ptr + f, tl.load(free_ptr + new_top + f, mask=f < n_fresh, other=0), mask=f < n_fresh)
        tl.store(top_ptr, new_top)

    @triton.jit(do_not_specialize=["window"])
    def _decide_leaving_kernel(scores_ptr, ids_ptr, lengths_ptr, leaving_ptr, freed_ptr, threshold, window, stride_row,
                               SPAN: tl.constexpr):
        r = tl.program_id(0)
        length = tl.load(lengths_ptr + r)
        column = length - window - 1
        row = ids_ptr + r.to(tl.int64) * stride_row
        go = (tl.load(leaving_ptr + r) != 0) & (column >= 0)
        candidate = tl.load(row + tl.maximum(column, 0), mask=go, other=0)
        DTYPE: tl.constexpr = scores_ptr.dtype.element_ty
        score = tl.load(scores_ptr + candidate.to(tl.int64), mask=go, other=0.0)
        evict = go & (widen_scores(score, DTYPE) < tau_in_dtype(tl.cast(threshold, tl.float32), DTYPE))  # strict <: NaN is kept
        offs = tl.arange(0, SPAN)
        move = offs < tl.where(evict, window, 0)  # columns column+1 ... length-1 (window of them) move one left
        tail = tl.load(row + column + 1 + offs, mask=move, other=0)
        # Every thread's loads (the tail, the length) before any store: without this barrier a warp could write
        # row[column + 32 k] before the warp below read it (the shift overlaps itself across warps).
        tl.debug_barrier()
        tl.store(row + column + offs, tail, mask=move)
        tl.store(lengths_ptr + r, tl.where(evict, length - 1, length))
        tl.store(freed_ptr + r, tl.where(evict, candidate, -1))


def launch_decide_leaving(scores: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor, leaving: torch.Tensor,
                          threshold: float, window: int, freed: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel of ``decide_leaving`` (same contract). ``ids`` int32 rows with contiguous columns, lengths
    int32, leaving int32/bool; ``freed``: an int32 [rows] buffer to fill (allocated when None)."""
    if triton is None:
        from kvzap_export.errors import MissingDependencyError

        raise MissingDependencyError("the decode decision kernel needs triton: pip install 'kvzap-export[gpu]'")
    _check(scores, ids, lengths, leaving, window)
    if ids.dtype != torch.int32 or lengths.dtype != torch.int32 or ids.stride(1) != 1:
        raise InputError("decode decision kernel: ids and lengths int32, ids' columns contiguous")
    rows = ids.shape[0]
    freed = torch.empty(rows, dtype=torch.int32, device=ids.device) if freed is None else freed
    if rows:
        span = max(16, triton.next_power_of_2(max(window, 1)))
        _decide_leaving_kernel[(rows,)](scores, ids, lengths, leaving, freed, float(threshold), int(window),
                                        ids.stride(0), SPAN=span)
    return freed


def launch_recycle(freed: torch.Tensor, free: torch.Tensor, top: torch.Tensor, fresh: torch.Tensor) -> None:
    """The Triton kernel of ``recycle`` (same contract; contiguous int32 freed, free and fresh, int64 top): one
    program, no host sync, no allocation."""
    if triton is None:
        from kvzap_export.errors import MissingDependencyError

        raise MissingDependencyError("the free stack kernel needs triton: pip install 'kvzap-export[gpu]'")
    if not (freed.dtype == free.dtype == fresh.dtype == torch.int32 and top.dtype == torch.int64 and top.numel() == 1):
        raise InputError("free stack kernel: freed, free and fresh int32, top int64 [1]")
    if not (freed.is_contiguous() and free.is_contiguous() and fresh.is_contiguous()):
        raise InputError("free stack kernel: freed, free and fresh contiguous")
    rows, n = freed.numel(), fresh.numel()
    _recycle_kernel[(1,)](freed, free, top, fresh, rows, n, ROWS=max(16, triton.next_power_of_2(max(rows, 1))),
                          FRESH=max(16, triton.next_power_of_2(max(n, 1))))
