"""The decision a decode step makes per (request, KV head) row (kvpress ``decoding=True``): the one entry that
left the recent window this step is tested against τ and, if evicted, taken out of the row.

Per row ``r`` of entry ids (``ids[r, :lengths[r]]``, ascending logical positions, the last ``window`` of them inside
the window): when ``leaving[r]`` is set (a token left the window this step and it is not a protected ``sink``
position) the candidate is the entry at column ``c = lengths[r] - window - 1``; if its stored score is below τ
(strict ``<`` in the scores' dtype, so NaN is kept) the window's columns ``c + 1 ... lengths[r] - 1`` move one
column left, ``lengths[r]`` drops by one and ``freed[r]`` is the candidate's id; otherwise ``freed[r] = -1``.
Rows shorter than ``window + 1`` are left alone.

This module is the rule's device implementation, the one the engine runs (``RaggedStore.decide_decode``) and the
benchmarks time (``bench/ragged_step.py``, ``bench/overhead.py``); its reference is kvpress's rule as
``ops.compaction`` writes it (``RequestState``, ``RaggedStore.decide_prefill``), which the tests compare it with:

- ``decide_leaving``: the torch formula over rows (any device; the CPU path);
- ``launch_decide_leaving``: its Triton kernel, one program per row, in place (a barrier between the row's loads and
  its stores: the shift overlaps itself), no host sync, no allocation given ``freed``: what a decode CUDA graph can
  capture. Under ``TRITON_INTERPRET=1`` it runs on CPU tensors (tests);
- ``decide_table``: either of them on the rows of chosen slots of a [slots, layers, heads, width] row table (the
  store's): the kernel in place on the table, the formula on each row's tail.

What a decision frees goes back to a free stack on the device, and entry ids come from it: ``push`` puts the freed ids
(``freed >= 0``) in order on ``free[:top]``, ``pop`` takes ``n`` ids from the top (``fresh[i] = free[top - n + i]``),
``recycle`` does both (a decode step: the freed ids, then the next step's). ``free`` has one spare element past its
capacity, which ``push`` writes for the ids that are not freed; ``top`` is an int64 [1] device tensor; the caller keeps
at least ``n`` ids on the stack. No host read: the host learns the new top when it asks (``RaggedStore``'s snapshots).
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


def full_stack(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A free stack holding the ids 0 .. n-1, the first popped 0, 1, 2, ... (ascending): ``free`` int32 [n + 1] (its
    spare element last) and ``top`` int64 [1], on ``device``."""
    free = torch.cat([torch.arange(n - 1, -1, -1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)]).to(device)
    return free, torch.full((1,), n, dtype=torch.int64, device=device)


def push(freed: torch.Tensor, free: torch.Tensor, top: torch.Tensor) -> None:
    """The free stack's push (module docstring): the ids ``freed >= 0`` (int32, any shape; -1: nothing) go on
    ``free[top:]`` in their order, ``top`` (int64 [1]) grows by their number. In place, no host read."""
    freed = freed.reshape(-1)
    gone = freed >= 0
    where = torch.where(gone, top + torch.cumsum(gone, 0) - 1, free.shape[0] - 1)  # the spare element: nothing freed
    free.index_put_((where,), freed.to(free.dtype))
    top.add_(gone.sum())


def pop(free: torch.Tensor, top: torch.Tensor, fresh: torch.Tensor) -> None:
    """The free stack's pop: ``fresh`` (int32, any shape, ``n`` elements) = ``free[top - n : top]``, ``top`` drops by
    ``n``. The caller keeps at least ``n`` ids on the stack. In place, no host read."""
    n = fresh.numel()
    fresh.view(-1).copy_(free[top - n + torch.arange(n, device=top.device)])
    top.sub_(n)


def recycle(freed: torch.Tensor, free: torch.Tensor, top: torch.Tensor, fresh: torch.Tensor) -> None:
    """A decode step's stack work: ``push`` the freed ids, then ``pop`` the next step's (pushed ids included)."""
    push(freed, free, top)
    pop(free, top, fresh)


if triton is not None:

    @triton.jit(do_not_specialize=["window", "per_slot"])
    def _decide_leaving_kernel(scores_ptr, ids_ptr, lengths_ptr, leaving_ptr, freed_ptr, slots_ptr, base_ptr, threshold,
                               window, stride_row, per_slot, SPAN: tl.constexpr, MAPPED: tl.constexpr):
        p = tl.program_id(0)
        if MAPPED:  # program p: row (p % per_slot) of table slot slots[p // per_slot], at base[row]; leaving per slot
            b = p // per_slot
            r = tl.load(slots_ptr + b).to(tl.int64) * per_slot + p % per_slot
            leave = tl.load(leaving_ptr + b)
            row = ids_ptr + tl.load(base_ptr + r)
        else:
            r = p.to(tl.int64)
            leave = tl.load(leaving_ptr + p)
            row = ids_ptr + r * stride_row
        length = tl.load(lengths_ptr + r)
        column = length - window - 1
        go = (leave != 0) & (column >= 0)
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
        tl.store(freed_ptr + p, tl.where(evict, candidate, -1))


def _require_triton(what: str) -> None:
    if triton is None:
        from kvzap_export.errors import MissingDependencyError

        raise MissingDependencyError(f"{what} needs triton: pip install 'kvzap-export[gpu]'")


def launch_decide_leaving(scores: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor, leaving: torch.Tensor,
                          threshold: float, window: int, freed: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel of ``decide_leaving`` (same contract). ``ids`` int32 rows with contiguous columns, lengths
    int32, leaving int32/bool; ``freed``: an int32 [rows] buffer to fill (allocated when None)."""
    _require_triton("the decode decision kernel")
    _check(scores, ids, lengths, leaving, window)
    if ids.dtype != torch.int32 or lengths.dtype != torch.int32 or ids.stride(1) != 1:
        raise InputError("decode decision kernel: ids and lengths int32, ids' columns contiguous")
    rows = ids.shape[0]
    freed = torch.empty(rows, dtype=torch.int32, device=ids.device) if freed is None else freed
    if rows:
        _decide_leaving_kernel[(rows,)](scores, ids, lengths, leaving, freed, freed, freed, float(threshold),
                                        int(window), ids.stride(0), 1, SPAN=_span(window), MAPPED=False)
    return freed


def _span(window: int) -> int:
    return max(16, triton.next_power_of_2(max(window, 1)))


def decide_table(scores: torch.Tensor, data: torch.Tensor, base: torch.Tensor, lengths: torch.Tensor,
                 slots: torch.Tensor, leaving: torch.Tensor, threshold: float, window: int,
                 use_triton: bool | None = None) -> torch.Tensor:
    """The decode decision of the slots ``slots`` (int64 [B], distinct, on the device) of a row table whose rows
    lie in one flat buffer: ``data`` int32 [size + 1] (the last element a scratch cell that masked writes land in),
    row ``(s, l, h)`` starting at ``base`` int64 [S, L, H] (``integrations.row_table.RowTable``; a dense table is
    the case ``base = arange * width``), lengths int32 [S, L, H]. Every (layer, head) row of slot ``slots[b]``
    decides when ``leaving[b]`` (int/bool [B]) is set, in place. Returns ``freed`` int32 [B, L, H] (-1: nothing
    freed). No host read, no sort.

    ``use_triton`` (default: CUDA tensors and Triton present): the kernel, in place on the buffer (one program per
    (slot, layer, head)); otherwise the torch formula ``decide_leaving`` over each row's last ``window + 1`` columns,
    gathered and written back (the columns past a row's length to the scratch cell)."""
    S, L, H = lengths.shape
    B = slots.shape[0]
    if base.shape != (S, L, H) or leaving.shape != (B,) or slots.dim() != 1 or data.dim() != 1:
        raise InputError(f"decide_table: data [size + 1], base and lengths [S, L, H], slots and leaving [B]; got "
                         f"{list(data.shape)}, {list(base.shape)}, {list(lengths.shape)}, {list(slots.shape)}, "
                         f"{list(leaving.shape)}")
    if use_triton is None:
        use_triton = data.is_cuda and triton is not None
    freed = torch.empty(B, L, H, dtype=torch.int32, device=data.device)
    if B == 0:
        return freed
    if use_triton:
        _require_triton("the decode decision kernel")
        if data.dtype != torch.int32 or lengths.dtype != torch.int32 or not (lengths.is_contiguous() and base.is_contiguous()):
            raise InputError("decide_table: data and lengths int32, lengths and base contiguous")
        _decide_leaving_kernel[(B * L * H,)](scores, data, lengths, leaving, freed, slots, base, float(threshold),
                                             int(window), 0, L * H, SPAN=_span(window), MAPPED=True)
        return freed
    # The torch formula on each row's tail (the candidate and the window after it).
    scratch = data.shape[0] - 1
    held = lengths[slots].to(torch.int64)  # [B, L, H]
    start = (held - window - 1).clamp(min=0)
    columns = start[..., None] + torch.arange(window + 1, device=data.device)  # [B, L, H, window + 1]
    at = (base[slots][..., None] + columns).clamp(max=scratch)
    tail = data[at].reshape(B * L * H, window + 1)
    tail_len = (held - start).to(torch.int32).reshape(-1)
    rows_leaving = leaving.reshape(B, 1).expand(B, L * H).reshape(-1)
    freed.view(-1).copy_(decide_leaving(scores, tail, tail_len, rows_leaving, threshold, window))
    inside = columns < held[..., None]  # a row's own columns only: past its length may be another row's
    data.index_put_((torch.where(inside, at, scratch),), tail.view(B, L, H, window + 1))
    lengths.index_put_((slots,), lengths[slots] - (freed >= 0).to(lengths.dtype))
    return freed
