"""Every layer's flattened decode rows of one step, laid out once before the forward in buffers allocated once.

The engine's ragged decode on CUDA (``integrations/sglang/ragged_decode.py``) attends, layer by layer, through
SGLang's decode kernel (``flattened_attention.launch``): row ``s`` of a layer is one (request, KV head) with its
query group. ``FlattenedStep`` lays out the rows of ALL layers at once, before the forward, from the store's row
tables (a ``RowTable``'s rows, each with its own capacity in one flat buffer, or a dense [slots, L, H, W] table, and
``lengths`` [slots, L, H]), so that the forward itself (what a CUDA
graph captures) only reads fixed buffers (except an eager step laid out layer by layer, below):

- rows in (layer, request, head) order: with ``B`` requests this step (padded: a row whose slot is -1 holds
  nothing), layer ``l``'s rows are ``l * B * H ... (l + 1) * B * H - 1``;
- ``kv_indptr`` int32 [L * max_rows + 1]: the running sum of the rows' lengths over all layers, so layer ``l``'s
  slice ``kv_indptr[l * R : (l + 1) * R + 1]`` (R = B * H) holds absolute offsets into the one ``kv_indices``;
- ``kv_indices`` int64 [entries + 1]: each row's entry ids, in its order, copied from the row tables (the last
  element is a discard slot the torch path writes padding to); int64 because SGLang's kernel computes the element
  offset ``id * row_stride`` in the dtype of ``kv_indices`` (``flattened_attention``'s docstring). Rows that share
  entries (a prefix SGLang's radix cache gave several requests) can hold more ids than the pool has entries: such a
  step (``fits``: the caller's host bounds) runs eagerly and copies each layer's ids just before that layer's
  attention, at offsets from the layer's first row (``layer_indptr``: that layer's running sum, so only a layer's
  ids need int32 offsets), into the fixed buffer, which holds one layer's ids unless the rows share about more than
  ``layers`` times over (then one layer's worth of ids of its own, as SGLang's Triton backend allocates for its eager
  steps; the row tables are then read during the forward; the step lets both go once its last layer's attention
  is launched); a CUDA graph reads the ids laid out before it, so it must not replay such a step;
- ``num_kv_splits`` int32 [L * max_rows]: per layer, ``ceil(length / chunk)`` clamped to [1, max_kv_splits] with
  ``chunk = max(min_chunk, ceil(layer total / target_programs))``; ``empty`` bool [L * max_rows];
- ``attn_logits`` / ``attn_lse``: the kernel's partial results, one layer's rows (layers run one after another),
  for ``logits_batch`` requests (the largest captured batch: a graph's launches must read fixed buffers); a larger
  (eager) step allocates its own per call, as SGLang's Triton backend does for eager steps. They are held flat, as
  ``split_rows`` (row, split) slots: a step of ``R`` rows runs at most ``splits_for(R)`` splits per row, which is
  ``small_batch_splits`` for a step of at most ``SMALL_BATCH`` requests (the buffers are sized for them) and
  ``max_kv_splits`` otherwise. A small batch has too few rows to fill the GPU (8 rows
  at batch 1 of Llama-3.1-8B); more splits per row spread its entries over more programs (on an H100, batch 1 x
  32k x 70% pruned: 64 splits 54.8 us, 32 splits 64.1 us; docs/benchmarks-history.md).

The copy of the ids reads only the entries held: a Triton kernel (one program per (row, block of 1024 columns);
programs past a row's length return at once), or on the CPU (no Triton launch outside the interpreter) a torch
scatter of the padded rows. Nothing reads the device back; a step that fits allocates nothing on the Triton path.
"""

from __future__ import annotations

import torch

from kvzap_export.errors import InputError
from kvzap_export.kernels import sglang_kernels
from kvzap_export.kernels.flattened_attention import launch

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError:  # pragma: no cover - exercised where triton is absent
    triton = None

COPY_BLOCK = 1024  # row columns per program of the id copy
SMALL_BATCH = 4  # requests a step may have and still run small_batch_splits (the buffers are sized for them)
GPU_SPLITS, GPU_SMALL_BATCH_SPLITS = 32, 64  # what the engine runs on a GPU (integrations/sglang/ragged.py)

if triton is not None:

    @triton.jit(do_not_specialize=["first_layer"])  # one compilation for every layer of a step laid out by layer
    def _copy_rows_kernel(data_ptr, base_ptr, lengths_ptr, indptr_ptr, slots_ptr, out_ptr, batch, heads, layers,
                          first_layer, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # (layer, request, head) of the rows from ``first_layer`` on
        start = tl.program_id(1) * BLOCK
        n = tl.load(lengths_ptr + first_layer * heads * batch + row)  # every layer's lengths; offsets from row 0
        if start < n:
            h = row % heads
            b = (row // heads) % batch
            layer = first_layer + row // (heads * batch)
            slot = tl.load(slots_ptr + b).to(tl.int64)
            base = tl.load(base_ptr + (slot * layers + layer) * heads + h)  # where the row's columns start
            cols = start + tl.arange(0, BLOCK)
            held = cols < n
            ids = tl.load(data_ptr + base + cols, mask=held, other=0)
            dst = tl.load(indptr_ptr + row).to(tl.int64) + cols
            tl.store(out_ptr + dst, ids.to(tl.int64), mask=held)


def split_rows(max_batch: int, kv_heads: int, logits_batch: int, max_kv_splits: int, small_batch_splits: int) -> int:
    """(row, split) slots of the partial results (module docstring)."""
    rows = logits_batch * kv_heads * max_kv_splits
    if small_batch_splits > max_kv_splits:
        rows = max(rows, min(max_batch, SMALL_BATCH) * kv_heads * small_batch_splits)
    return rows


def step_bytes(layers: int, max_batch: int, kv_heads: int, group: int, head_dim: int, v_head_dim: int,
               dtype: torch.dtype, logits_batch: int, max_kv_splits: int, small_batch_splits: int) -> int:
    """Bytes a ``FlattenedStep`` of these sizes allocates besides ``kv_indices`` (one int64 per entry, which a KV
    budget counts per entry): what an engine sets aside for it before sizing its pool."""
    logits_batch = min(logits_batch, max_batch)
    splits = split_rows(max_batch, kv_heads, logits_batch, max_kv_splits, max(max_kv_splits, small_batch_splits))
    all_rows = layers * max_batch * kv_heads
    size = torch.empty(0, dtype=dtype).element_size()
    return (4 * (all_rows + 1) + 4 * all_rows + all_rows + 4 * splits * group * (v_head_dim + 1)
            + 4 * (max_batch * kv_heads + 1)
            + size * max_batch * kv_heads * group * head_dim + 4 * all_rows + 4 * max_batch * layers * kv_heads
            + 4 * max_batch + 8 * max_batch + 4 * layers)


def row_buffers(table) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, base) of row tables: a ``RowTable``'s own, or a dense [S, L, H, W] tensor's (its flat view, rows every
    ``W`` columns)."""
    if isinstance(table, torch.Tensor):
        if table.dim() != 4:
            raise InputError(f"row tables: a RowTable or a dense [S, L, H, W] tensor, got {list(table.shape)}")
        S, L, H, W = table.shape
        return table.reshape(-1), torch.arange(S * L * H, device=table.device).view(S, L, H) * W
    return table.data, table.base


class FlattenedStep:
    """The buffers and launches of one step's flattened decode over ``layers`` layers (module docstring).

    ``max_batch`` requests of ``kv_heads`` heads, ``group`` query heads per KV head, head dims, ``entries``: the most
    entry ids a step can hold over all its layers (the store's capacity); ``logits_batch``: requests the partial-result
    buffers hold (default ``max_batch``). ``use_triton``: the id copy's path (default: on CUDA tensors).
    ``small_batch_splits``: splits per row of a small step (module docstring; default, and at least,
    ``max_kv_splits``)."""

    def __init__(self, layers: int, max_batch: int, kv_heads: int, group: int, head_dim: int, entries: int, *,
                 v_head_dim: int | None = None, dtype: torch.dtype = torch.bfloat16, device="cuda",
                 max_kv_splits: int = 32, target_programs: int | None = None, min_chunk: int = 64,
                 kernels: sglang_kernels.SGLangKernels | None = None, kernel_path=None, use_triton: bool | None = None,
                 logits_batch: int | None = None, small_batch_splits: int | None = None):
        if min(layers, max_batch, kv_heads, group, head_dim, entries, max_kv_splits, min_chunk) <= 0:
            raise InputError(f"FlattenedStep needs positive sizes, got layers {layers}, batch {max_batch}, kv_heads "
                             f"{kv_heads}, group {group}, head_dim {head_dim}, entries {entries}")
        if entries + (target_programs or 2**16) >= 2**31 - 1:  # int32 offsets, and a layer total + target_programs
            raise InputError(f"FlattenedStep: {entries} entries do not fit the kernel's int32 kv_indptr")
        self.kernels = kernels if kernels is not None else sglang_kernels.load(kernel_path)
        self.layers, self.max_batch, self.kv_heads, self.group = layers, max_batch, kv_heads, group
        self.head_dim, self.v_head_dim = head_dim, v_head_dim or head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.max_kv_splits, self.min_chunk = max_kv_splits, min_chunk
        self.small_batch_splits = max(max_kv_splits, small_batch_splits or max_kv_splits)
        if target_programs is None:
            cores = sglang_kernels.get_device_core_count(self.device.index or 0) if self.device.type == "cuda" else 0
            target_programs = 32 * cores if cores > 0 else 256
        self.target_programs = target_programs
        self.use_triton = (self.device.type == "cuda") if use_triton is None else use_triton
        if self.use_triton and triton is None:
            raise InputError("FlattenedStep: the id copy's Triton kernel needs triton (pip install triton)")
        logits_batch = max_batch if logits_batch is None else min(logits_batch, max_batch)
        all_rows, dev = layers * max_batch * kv_heads, self.device
        self.kv_indptr = torch.zeros(all_rows + 1, dtype=torch.int32, device=dev)
        self.kv_indices = torch.zeros(entries + 1, dtype=torch.int64, device=dev)
        self.num_kv_splits = torch.ones(all_rows, dtype=torch.int32, device=dev)
        self.empty = torch.ones(all_rows, dtype=torch.bool, device=dev)
        self.split_rows = split_rows(max_batch, kv_heads, logits_batch, max_kv_splits, self.small_batch_splits)
        self.attn_logits = torch.zeros(self.split_rows * group * self.v_head_dim, dtype=torch.float32, device=dev)
        self.attn_lse = torch.zeros(self.split_rows * group, dtype=torch.float32, device=dev)
        self._q = torch.zeros(max_batch * kv_heads, group, head_dim, dtype=dtype, device=dev)  # queries not viewable
        self._lens = torch.zeros(all_rows, dtype=torch.int32, device=dev)
        self._gathered = torch.zeros(max_batch, layers, kv_heads, dtype=torch.int32, device=dev)
        self._valid = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self._safe = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self._chunk = torch.zeros(layers, dtype=torch.int32, device=dev)
        self._layer_indptr = torch.zeros(max_batch * kv_heads + 1, dtype=torch.int32, device=dev)
        self.batch = 0
        self.indices = self.kv_indices  # the ids the filled step attends over (its own where one layer's do not fit)
        self._by_layer = None  # (data, base, width) of a step whose ids are copied layer by layer
        self._spent = False  # such a step's last layer attended: its ids (and tables) let go until the next fill

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every tensor this instance allocated (their data pointers never change)."""
        return {"kv_indptr": self.kv_indptr, "kv_indices": self.kv_indices, "num_kv_splits": self.num_kv_splits,
                "empty": self.empty, "attn_logits": self.attn_logits, "attn_lse": self.attn_lse, "q": self._q,
                "lens": self._lens, "gathered": self._gathered, "valid": self._valid, "safe": self._safe,
                "chunk": self._chunk, "layer_indptr": self._layer_indptr}

    def splits_for(self, rows: int) -> int:
        """The most splits per row of a step of ``rows`` rows (module docstring)."""
        # split_rows holds min(max_batch, SMALL_BATCH) requests at small_batch_splits, and fill refuses larger steps
        return self.small_batch_splits if rows <= SMALL_BATCH * self.kv_heads else self.max_kv_splits

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers().values())

    def fits(self, ids: int) -> bool:
        """Whether ``ids`` entry ids (a step's over all its rows and layers, or one layer's) fit ``kv_indices``
        (module docstring)."""
        return ids < self.kv_indices.shape[0]

    def fill(self, table, lengths: torch.Tensor, slots: torch.Tensor, width: int, ids: int | None = None,
             layer_ids: int | None = None) -> None:
        """Lays out a step of ``B = len(slots)`` requests from the row tables: ``table`` a ``RowTable`` (``data`` int32,
        ``base`` int64 [S, L, H]) or a dense int32 [S, L, H, W'], lengths int32 [S, L, H], slots int64 [B] on the device
        (-1: a padding row, which holds nothing); ``width``: at least the longest row of these requests (host; the
        torch path pads to it); ``ids``: at least the entry ids of these rows over every layer (host; default: what
        ``kv_indices`` holds): a step past ``fits`` copies each layer's ids before its attention (``layer_ids``: at
        least the most ids one layer's rows hold, host; default ``ids``), into ids of its own only where one layer's
        do not fit."""
        L, H = self.layers, self.kv_heads
        B = slots.shape[0]
        data, base = row_buffers(table)
        if tuple(base.shape[1:]) != (L, H) or tuple(lengths.shape) != tuple(base.shape):
            raise InputError(f"FlattenedStep.fill: tables of [S, {L}, {H}] rows and lengths [S, {L}, {H}], got "
                             f"{list(base.shape)} rows and {list(lengths.shape)}")
        if B > self.max_batch or B == 0:
            raise InputError(f"FlattenedStep.fill: {B} requests, the buffers hold 1 to {self.max_batch}")
        width = int(width)
        R, n = B * H, L * B * H
        self.batch = B
        valid, safe, gathered = self._valid[:B], self._safe[:B], self._gathered[:B]
        torch.ge(slots, 0, out=valid)
        torch.clamp(slots, min=0, out=safe)
        torch.index_select(lengths, 0, safe, out=gathered)
        gathered.mul_(valid[:, None, None])
        lens = self._lens[:n]
        lens.view(L, B, H).copy_(gathered.permute(1, 0, 2))
        torch.eq(lens, 0, out=self.empty[:n])
        fixed = ids is None or self.fits(ids)
        layer_ids = ids if layer_ids is None else layer_ids
        if not fixed and layer_ids + self.target_programs >= 2**31 - 1:  # a layer's offsets and splits are int32
            raise InputError(f"FlattenedStep.fill: a layer of {layer_ids} entry ids does not fit the kernel's int32 "
                             "kv_indptr (fewer requests sharing a cached prefix at once: lower max_running_requests)")
        self._by_layer, self._spent = (None if fixed else (data, base, width)), False
        self.indices = (self.kv_indices if fixed or self.fits(layer_ids)
                        else torch.empty(layer_ids + 1, dtype=torch.int64, device=self.device))
        # per layer: chunk = max(min_chunk, ceil(total / target_programs)); splits = clamp(ceil(len / chunk), 1, S)
        chunk = self._chunk
        if fixed:  # every layer's offsets in one running sum (what a graph reads), then the ids
            torch.cumsum(lens, 0, dtype=torch.int32, out=self.kv_indptr[1: n + 1])
            self._copy(data, base, width, self.kv_indptr, 0, L)
            torch.sub(self.kv_indptr[R: n + 1: R], self.kv_indptr[0: n: R], out=chunk)
        else:  # each layer's offsets at its attention (``attend``)
            torch.sum(lens.view(L, R), 1, dtype=torch.int32, out=chunk)
        chunk.add_(self.target_programs - 1).div_(self.target_programs, rounding_mode="floor").clamp_(min=self.min_chunk)
        splits = self.num_kv_splits[:n].view(L, R)
        torch.add(lens.view(L, R), chunk[:, None], out=splits)
        splits.sub_(1).div_(chunk[:, None], rounding_mode="floor").clamp_(1, self.splits_for(R))

    def _copy(self, data, base, width: int, indptr: torch.Tensor, first: int, layers: int) -> None:
        """The ids of the rows of ``layers`` layers from layer ``first`` (offsets ``indptr`` from their first row)
        into ``indices``: the Triton kernel, or without Triton a torch scatter of the padded rows [layers, B, H,
        width], padding to the discard slot."""
        if width <= 0:
            return
        B, H = self.batch, self.kv_heads
        safe = self._safe[:B]
        if self.use_triton:
            grid = (layers * B * H, triton.cdiv(width, COPY_BLOCK))
            _copy_rows_kernel[grid](data, base, self._lens, indptr, safe, self.indices, B, H, self.layers, first,
                                    BLOCK=COPY_BLOCK)
            return
        lens = self._lens[first * B * H: (first + layers) * B * H]
        columns = torch.arange(width, device=self.device)
        at = (base.index_select(0, safe)[:, first: first + layers, :, None] + columns).clamp(max=data.shape[0] - 1)
        rows = data[at].permute(1, 0, 2, 3).reshape(layers * B * H, width)
        held = columns < lens[:, None]
        dest = torch.where(held, indptr[: layers * B * H, None].to(torch.int64) + columns, self.indices.shape[0] - 1)
        self.indices.index_put_((dest.reshape(-1),), rows.reshape(-1).to(torch.int64))

    def attend(self, layer: int, q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, scale: float,
               out: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s attention for the filled step: q [B, kv_heads * group, D] (B = the filled batch), stores
        [E, D] / [E, Dv]; ``out`` [B, q_heads, Dv] contiguous. Returns out. A step laid out layer by layer attends each
        layer once, the last one last: after it, attending again before the next ``fill`` raises."""
        R = self.batch * self.kv_heads
        if not 0 <= layer < self.layers:
            raise InputError(f"FlattenedStep.attend: layer {layer} of {self.layers}")
        if self._spent:
            raise RuntimeError("FlattenedStep.attend: this step was laid out layer by layer and its last layer has "
                               "attended (its ids are let go); fill the next step first")
        first, G, S = layer * R, self.group, self.splits_for(R)
        if R * S <= self.split_rows:
            logits = self.attn_logits[: R * G * S * self.v_head_dim].view(R, G, S, self.v_head_dim)
            lse = self.attn_lse[: R * G * S].view(R, G, S)
        else:  # an eager step past the graphs' largest batch: its own partial results
            logits = self.attn_logits.new_empty(R, G, S, self.v_head_dim)
            lse = self.attn_lse.new_empty(R, G, S)
        indptr = self.kv_indptr[first: first + R + 1]
        if self._by_layer is not None:  # the step's ids past the buffer: this layer's now, from offset 0
            indptr = self._layer_indptr[: R + 1]  # its first element stays 0
            torch.cumsum(self._lens[first: first + R], 0, dtype=torch.int32, out=indptr[1:])
            data, base, width = self._by_layer
            self._copy(data, base, width, indptr, layer, 1)
        out = launch(self.kernels, q, k_store, v_store, scale, rows=R, kv_heads=self.kv_heads, group=self.group,
                     head_dim=self.head_dim, v_head_dim=self.v_head_dim,
                     kv_indptr=indptr, kv_indices=self.indices,
                     num_kv_splits=self.num_kv_splits[first: first + R], attn_logits=logits, attn_lse=lse,
                     empty=self.empty[first: first + R], spare_q=self._q, out=out)
        if self._by_layer is not None and layer == self.layers - 1:
            # the forward's last attention is launched: the step's own ids and its hold on the tables (which a
            # packing may have replaced) go now, not at the next decode layout (a prefill may come first). The ids
            # were allocated on the forward's stream (``fill``, inside SGLang's forward), so the caching allocator
            # reuses them only after the kernels queued there. Replaced tables were allocated, and are reused, on
            # SGLang's scheduling stream; that stream waits for an eager forward to end before its next batch's
            # preparation (SGLang 0.5.23's write-after-read barrier), as it did when the next fill let them go.
            self._by_layer, self.indices, self._spent = None, self.kv_indices, True
        return out
