"""Per-head KV storage: one-head entries in one pool, a row of entry ids per (request, layer, KV head).

Engine-independent (pure torch). The SGLang ragged mode (``integrations/sglang/ragged.py``) keeps its
requests' K/V here; the design is in docs/ragged-kv.md. Every operation takes a whole step's requests at
once: no loop over requests reads the device, and a step reads it back at most once (the lengths its
decisions left).

The pool, ``capacity`` entries (one entry = one token of one KV head of one layer):

- ``k`` [capacity + 1, D], ``v`` [capacity + 1, Dv]: the entry's K and V, in the model's dtype, each contiguous
  (decode attention gathers keys and reads values in place, ``kernels.ragged_attention``); the last row,
  ``scratch``, is no entry: the writes of a CUDA graph's padding rows land there and nothing reads it;
- ``scores`` [capacity + 1]: the surrogate score of the entry's (token, layer, head), kept until a decision tests
  it (in the model's dtype: kvpress compares in it);
- a free list: a stack of entry ids on the device (``top``, an int64 [1] device tensor: ``kernels.decode_decision``'s
  ``push`` / ``pop``), plus one spare slot that masked writes land in; an append takes the top of the stack in
  ascending order, so each (layer, head) of a prompt gets ascending ids.

The rows: a table per request that holds entries (SGLang's ``req_pool_idx`` maps to a table slot, taken at its
first entry and given back at its release, so the tables follow the requests held, not the engine's row count):

- ``table`` (``row_table.RowTable``): each (request, layer, head)'s entry ids in ascending logical positions, every
  row with its own capacity in one flat buffer (an engine reserves it with the pool: ``reserve_table``);
- ``lengths`` int32 [slots, L, H] on the pool's device, mirrored on the host (``lengths_host``: an upper bound, exact
  once the decisions' snapshots are applied), so that a step's widths are known before its forward without reading
  the device;
- ``logical`` (host): tokens appended per request row; ``tested`` (host): positions already decided on.

Host -> device copies (a step's slots, counts, positions) go through ``upload``: one copy per call, from pinned
memory and non-blocking on CUDA. Device -> host: none in a decision or a release; the host learns their results from
snapshots (``ragged_mirror.py``): ``available`` is a lower bound of the free entries until then.

Decisions follow kvpress ``DMSPress`` (DESIGN.md): strict ``score < threshold`` evicts, the last ``window``
logical positions and the first ``sink`` are kept. ``decide_prefill`` tests every entry of a (dense) prompt;
``decide_decode`` tests, per (layer, head), the one entry that left the window at this decode step (kvpress
``decoding=True``: each token is tested once, when it leaves the window) through ``kernels.decode_decision`` (the
rule's device implementation: its Triton kernel on CUDA, its torch formula elsewhere). Both return the entries freed
as a device tensor (reading it is the caller's host read).

Locality: decode attention on the CPU gathers every row's entries at every step, and a gather of entries
scattered over the pool costs more per entry than one of a dense run. So ``decide_prefill`` moves a prompt's
survivors (K, V, score; their order kept) into the row's first ids and frees its last ones: the row stays as
dense as its prompt was, and the freed ids come back as runs a later prompt takes in ascending order. A store
whose entries other rows or records refer to (``SharedRaggedStore``) sets ``moves_kept`` False.
"""

from __future__ import annotations

import logging

import torch

from kvzap_export.errors import InputError
from kvzap_export.integrations.ragged_mirror import HostMirror
from kvzap_export.integrations.row_table import MIN_COLUMNS, RowTable
from kvzap_export.kernels import decode_decision

log = logging.getLogger(__name__)


def upload(device: torch.device, *parts: torch.Tensor) -> list[torch.Tensor]:
    """Host int64 tensors -> views of ONE device copy (the step's one transfer for them): on CUDA from pinned memory
    and non-blocking (PyTorch's pinned-memory cache keeps the block until the copy has run), elsewhere as is."""
    sizes = [p.numel() for p in parts]
    flat = torch.cat([p.reshape(-1).to(torch.int64) for p in parts])
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    return [piece.view(p.shape) for piece, p in zip(flat.split(sizes), parts)]


class StoreFull(RuntimeError):
    """More entries were asked for than the pool has free (the engine's admission control let it through)."""


class RaggedStore:
    """The pool and the request rows (see the module docstring)."""

    moves_kept = True  # decide_prefill moves survivors to their row's first ids (module docstring)
    counts_releases = True  # a release of a row whose lengths the host knows pushes a number the host knows
    ranks = None  # a rank_room.RankRoom when tensor-parallel ranks share one view of the room (the engine sets it)

    def __init__(self, capacity: int, num_layers: int, num_kv_heads: int, head_dim: int, v_head_dim: int | None = None,
                 *, rows: int = 4, width: int = 16, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        if capacity <= 0 or num_layers <= 0 or num_kv_heads <= 0 or head_dim <= 0 or rows <= 0 or width <= 0:
            raise InputError(f"RaggedStore needs positive sizes, got capacity={capacity}, layers={num_layers}, "
                             f"kv_heads={num_kv_heads}, head_dim={head_dim}, rows={rows}, width={width}")
        if capacity >= 2**31:
            raise InputError(f"RaggedStore: {capacity} entries do not fit int32 entry ids; use a smaller pool")
        self.capacity, self.num_layers, self.num_kv_heads = capacity, num_layers, num_kv_heads
        self.head_dim, self.v_head_dim = head_dim, v_head_dim or head_dim
        self.device = torch.device(device)
        self.scratch = capacity  # the row past the entries (module docstring)
        self.k = torch.zeros(capacity + 1, self.head_dim, dtype=dtype, device=self.device)
        self.v = torch.zeros(capacity + 1, self.v_head_dim, dtype=dtype, device=self.device)
        self.scores = torch.zeros(capacity + 1, dtype=dtype, device=self.device)
        # Top of the stack = the end; the first ids taken are 0, 1, 2, ... (ascending, contiguous).
        self._free, self.top = decode_decision.full_stack(capacity, self.device)
        self.soft_counter = torch.zeros(1, dtype=torch.int64, device=self.device)  # SharedRaggedStore's soft entries
        self.mirror = HostMirror(self, capacity)
        # the rows' entry ids, each row with its own capacity (row_table.py); ``width`` columns a row to start with
        self.table = RowTable(rows, num_layers, num_kv_heads, rows * num_layers * num_kv_heads * width, self.device)
        self.table_columns = self._default_columns = self.table.size  # what a budget reserved (``reserve_table``)
        self.lengths = torch.zeros(rows, num_layers, num_kv_heads, dtype=torch.int32, device=self.device)
        self.host_lengths = torch.zeros(rows, num_layers, num_kv_heads, dtype=torch.int64)  # see lengths_host
        self.slot_of: dict[int, int] = {}  # request row -> its table slot
        self._free_slots = list(range(rows - 1, -1, -1))
        self.logical: dict[int, int] = {}  # request row -> tokens appended (rows present here hold entries)
        self.tested: dict[int, int] = {}  # request row -> logical positions below this one have been decided on
        self.decided: set[int] = set()  # request rows a decision has tested (no longer known to hold every token)
        self.graph_replays = 0  # decode steps an engine replayed from a CUDA graph (its readings' count)

    # ---- the pool ------------------------------------------------------------------------------
    @property
    def available(self) -> int:
        """Free entries: exact once the snapshots of earlier decisions and releases are applied, a lower bound before
        (``ragged_mirror.py``; on the CPU they are applied here)."""
        self.mirror.sync()
        return self.mirror.top

    @property
    def held(self) -> int:
        """Entries handed out (read from the free list, not from the rows; an upper bound like ``available``)."""
        return self.capacity - self.available

    @property
    def lengths_host(self) -> torch.Tensor:
        """int64 [slots, L, H] on the host: ``lengths``' mirror, an upper bound of it until the snapshots of the
        decisions are applied (``ragged_mirror.py``)."""
        self.mirror.sync()
        return self.host_lengths

    def exact(self) -> None:
        """Waits for every pending snapshot: ``available`` and ``lengths_host`` are then exact (a host read)."""
        self.mirror.wait()

    @property
    def rows(self) -> list[int]:
        """Request rows that hold entries."""
        return list(self.slot_of)

    def nbytes(self) -> dict[str, int]:
        """Bytes of each tensor the store allocated on its device: K, V, scores, row tables (ids, where rows start,
        lengths), free list. Its host mirrors (int64 per row) are host memory, not counted here."""
        size = lambda t: t.numel() * t.element_size()  # noqa: E731
        return {"k": size(self.k), "v": size(self.v), "scores": size(self.scores),
                "row_tables": self.table.nbytes() + size(self.lengths), "free_list": size(self._free)}

    def table_bytes(self) -> int:
        """Bytes of the row tables' ids buffer (its reservation; more only if packed rows outgrow it: logged)."""
        return self.table.data.numel() * self.table.data.element_size()

    def reserve_table(self, columns: int, slots: int | None = None) -> None:
        """The engine's reservation for the row tables, ``columns`` int32 columns' bytes, allocated now for up to
        ``slots`` requests at once (the engine's request rows): where each row starts and its length (int64 and int32
        per (slot, layer, head)) come out of the same bytes, the rest are the rows' columns. Before any row is held."""
        if self.slot_of:
            raise RuntimeError("ragged KV store: the row tables are reserved before any row is held")
        L, H = self.num_layers, self.num_kv_heads
        slots = max(slots or 0, self.lengths.shape[0])
        self._ensure_rows(slots)
        columns = max(columns - -(-slots * L * H * 12 // 4), L * H * MIN_COLUMNS)
        self.table = RowTable(slots, L, H, columns, self.device, reserved=True)
        self.table_columns = columns

    def _room(self, n: int) -> None:
        """Raises ``StoreFull`` unless ``n`` entries are free (waits for pending snapshots when the lower bound is short)."""
        if n > self.available:
            self.mirror.wait()
            if n > self.mirror.top:
                raise StoreFull(f"ragged KV store: {n} entries asked, {self.mirror.top} free of {self.capacity}")

    def _take(self, n: int) -> torch.Tensor:
        self._room(n)
        fresh = torch.empty(n, dtype=torch.int32, device=self.device)
        decode_decision.pop(self._free, self.top, fresh)
        self.mirror.popped(n)
        # ascending: a prompt's rows read their entries forwards (freed ids come back in any order)
        return torch.sort(fresh).values.to(torch.int64)

    def _give(self, ids: torch.Tensor, mask: torch.Tensor, count: int | None = None) -> None:
        """Pushes ``ids[mask]`` on the free list without reading the device (masked-out ids go to the spare slot past
        the stack). ``count``: how many, when the host knows it; otherwise the caller marks its device work for the
        host's next snapshot (``ragged_mirror.py``)."""
        decode_decision.push(torch.where(mask.reshape(-1), ids.reshape(-1).to(torch.int32), -1), self._free, self.top)
        if count is not None:
            self.mirror.pushed(count)

    def _ensure_rows(self, slots: int) -> None:
        """Room for at least ``slots`` request slots (by a quarter at a time; the rows' columns are the table's)."""
        have = self.lengths.shape[0]
        if slots <= have:
            return
        new = max(slots, -(-5 * have // 4))
        L, H = self.num_layers, self.num_kv_heads
        self.table.grow_slots(new)
        self.lengths = torch.cat([self.lengths, self.lengths.new_zeros(new - have, L, H)])
        self.host_lengths = torch.cat([self.host_lengths, self.host_lengths.new_zeros(new - have, L, H)])
        self._free_slots = list(range(new - 1, have - 1, -1)) + self._free_slots

    def _columns(self, slots_host: torch.Tensor, need: torch.Tensor) -> None:
        """Rows of ``slots_host`` get room for ``need`` [B, L, H] columns (host figures: the mirrored lengths are upper
        bounds)."""
        self.table.reserve(slots_host, need, lambda *parts: upload(self.device, *parts), self.lengths_host)

    def slots_host(self, rows: list[int]) -> torch.Tensor:
        """The table slots of request rows that hold entries, int64 on the host (for ``lengths_host[...]``)."""
        return torch.tensor([self.slot_of[r] for r in rows], dtype=torch.int64)

    def slots(self, rows: list[int]) -> torch.Tensor:
        """The table slots of request rows that hold entries, int64 on the pool's device (for ``ids[...]``)."""
        return upload(self.device, self.slots_host(rows))[0]

    # ---- a step's new tokens -------------------------------------------------------------------
    def append(self, rows: list[int], counts: list[int]) -> torch.Tensor:
        """Gives each row ``rows[b]`` one new entry per (layer, head) for each of its ``counts[b]`` new tokens, at the
        end of every (layer, head) row (logical positions ``logical ... logical + counts[b] - 1``).

        Returns the new entry ids int64 [L, H, T], T = sum(counts), tokens in the order of ``rows`` (the order a
        forward lays the step's tokens out in); each (layer, head) of a request gets consecutive ids.
        """
        if len(rows) != len(counts) or len(set(rows)) != len(rows) or any(n < 0 for n in counts):
            raise InputError(f"append: rows {rows} and counts {counts} must pair distinct rows with counts >= 0")
        L, H = self.num_layers, self.num_kv_heads
        total = sum(counts)
        if total == 0:
            return torch.zeros(L, H, 0, dtype=torch.int64, device=self.device)
        self._room(L * H * total)
        fresh = [r for r in rows if r not in self.slot_of]
        self._ensure_rows(len(self.slot_of) + len(fresh))
        for r in fresh:
            self.slot_of[r] = self._free_slots.pop()
            self.mirror.took_slot(r)
        slots_host = self.slots_host(rows)
        n_host = torch.tensor(counts, dtype=torch.int64)
        self._columns(slots_host, self.lengths_host[slots_host] + n_host[:, None, None])
        new = self._take(L * H * total).view(L, H, total)
        token_row = torch.repeat_interleave(torch.arange(len(rows)), n_host, output_size=total)  # [T] its request
        token_j = torch.arange(total) - torch.repeat_interleave(torch.cumsum(n_host, 0) - n_host, n_host, output_size=total)
        slots, token_row, token_j, n = upload(self.device, slots_host, token_row, token_j, n_host)
        columns = self.lengths[slots][token_row].permute(1, 2, 0).to(torch.int64) + token_j  # [L, H, T]
        layer = torch.arange(L, device=self.device)[:, None, None]
        head = torch.arange(H, device=self.device)[None, :, None]
        self.table.data[self.table.base[slots[token_row][None, None, :], layer, head] + columns] = new.to(torch.int32)
        self.lengths[slots] += n.to(torch.int32)[:, None, None]
        self.host_lengths[slots_host] += n_host[:, None, None]
        for r, n in zip(rows, counts):
            self.logical[r] = self.logical.get(r, 0) + n
        return new

    def layer_ids(self, slots: torch.Tensor, layer: int, width: int) -> torch.Tensor:
        """int32 [B, H, width]: one layer's entry ids of the requests in ``slots`` (padding past each row's length)."""
        return self.table.layer(slots, layer, width)

    def widths(self, rows: list[int]) -> list[int]:
        """Per layer, the most entries any (row, head) of ``rows`` holds (host, no device read)."""
        if not rows:
            return [0] * self.num_layers
        return self.lengths_host[self.slots_host(rows)].amax(dim=(0, 2)).tolist()

    # ---- decisions -------------------------------------------------------------------------------
    def decide_prefill(self, rows: list[int], threshold: float, window: int, sink: int = 0) -> torch.Tensor:
        """Tests every entry of each row's prompt (rows held densely: every head holds every token) with kvpress's
        rule and keeps the survivors, in order. Returns the entries freed (a device tensor). One threshold pass for all
        rows, no host read."""
        from kvzap_export.kernels.torch_ops import threshold_compaction

        if not rows:
            return torch.zeros((), dtype=torch.int64, device=self.device)
        L, H = self.num_layers, self.num_kv_heads
        bad = [r for r in rows if r in self.decided or r not in self.slot_of]
        if bad:
            raise InputError(f"decide_prefill: rows {bad} are not held densely (a prompt is decided once, whole)")
        for r in rows:
            self.tested[r] = max(0, self.logical[r] - window)
        self.decided.update(rows)
        rows_host = self.slots_host(rows)
        rows_dev = upload(self.device, rows_host)[0]
        width = max(self.logical[r] for r in rows)  # a dense row holds every token it appended
        ids = self.table.gather(rows_dev, width).to(torch.int64)  # [B, L, H, W]
        lengths = self.lengths[rows_dev]
        B = len(rows)
        rule = threshold_compaction(self.scores[ids].reshape(B * L * H, 1, width), lengths.reshape(-1), threshold, window,
                                    sink, check_lengths=False)
        keep = rule.keep.view(B, L, H, width)
        indices = rule.indices.view(B, L, H, width).to(torch.int64)
        kept_ids = torch.where(indices >= 0, ids.gather(-1, indices.clamp(min=0)), 0)
        held = torch.arange(width, device=self.device) < lengths[..., None]
        counts = rule.counts.view(B, L, H)
        if not self.moves_kept:
            return self._commit(rows, rows_dev, kept_ids, ids, held & ~keep, counts)
        # The survivors move into the row's first ids (their order kept), the row's last ids are freed: a row's
        # entries stay as dense in the pool as its prompt's were, which decode's gathers read at every step.
        moved = indices >= 0  # no host read (a mask's selection would be one): the rest copies the scratch entry
        src, dst = torch.where(moved, kept_ids, self.scratch), torch.where(moved, ids, self.scratch)
        for layer in range(L):  # a layer at a time: the copies' temporaries stay one layer's prompts
            for pool in (self.k, self.v, self.scores):
                pool[dst[:, layer]] = pool[src[:, layer]]  # the right side is a copy: overlapping ids are safe
        return self._commit(rows, rows_dev, torch.where(moved, ids, 0), ids, held & ~moved, counts)

    def decide_decode(self, rows: list[int], threshold: float, window: int, sink: int = 0) -> torch.Tensor:
        """After a decode token per row: per (layer, head), the entry that left the window (logical position
        ``logical - window - 1``, row index ``length - window - 1``: positions not decided yet are all held) is
        tested and, if evicted, removed (``decode_decision.decide_table``). A row where no untested position left the
        window is skipped (a short row, or no token since its last decision). Returns the entries freed (a device
        tensor). Host work: the rows' bookkeeping and one upload; no host read."""
        leaving = {r: self.logical.get(r, 0) - window - self.tested.get(r, 0) for r in rows}
        if any(m > 1 for m in leaving.values()):
            raise InputError(f"decide_decode: rows {[r for r, m in leaving.items() if m > 1]} moved more than one token "
                             "out of the window since their last decision (decide after every decode step)")
        rows = [r for r in rows if leaving[r] == 1]
        if not rows:
            return torch.zeros((), dtype=torch.int64, device=self.device)
        for r in rows:
            self.tested[r] = self.tested.get(r, 0) + 1
        self.decided.update(rows)
        outside_sink = torch.tensor([self.logical[r] - window - 1 >= sink for r in rows], dtype=torch.int64)
        slots, outside_sink = upload(self.device, self.slots_host(rows), outside_sink)
        freed = decode_decision.decide_table(self.scores, self.table.data, self.table.base, self.lengths, slots,
                                             outside_sink, threshold, window)
        gone = freed >= 0
        self._give(torch.where(gone, freed, self.scratch), gone)
        self.mirror.mark(rows)
        return gone.sum()

    def _commit(self, rows: list[int], rows_dev: torch.Tensor, kept: torch.Tensor, freed_ids: torch.Tensor,
                freed_mask: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Writes a prompt decision back: ``kept`` [B, L, H, W] into each row's first columns, the new lengths, one
        push of the freed ids; then a snapshot for the host. No host read. Returns the entries freed (a device
        tensor)."""
        before = self.lengths[rows_dev].to(torch.int64)
        self.table.write(rows_dev, kept, torch.arange(kept.shape[-1], device=self.device) < before[..., None])
        freed = (before - counts).sum()
        self.lengths[rows_dev] = counts.to(torch.int32)
        self._give(freed_ids, freed_mask)
        self.mirror.mark(rows)
        return freed

    # ---- releasing -------------------------------------------------------------------------------
    def release(self, row: int) -> int | None:
        """Frees every entry of row ``row`` (the request left it), on the device. Returns how many when the host knows
        it (its decisions' snapshots are applied; a ``SharedRaggedStore``'s entries may turn soft instead: never), else
        None (the host learns it from a snapshot). A row that holds nothing is fine (a request that never ran a
        forward)."""
        if self.counts_releases:  # the count is the host's to know when its mirror of the row is current
            self.mirror.sync()
        exact = self.counts_releases and self.mirror.exact(row)
        self.tested.pop(row, None)
        logical = self.logical.pop(row, 0)
        self.decided.discard(row)
        self.mirror.dropped(row)
        slot = self.slot_of.pop(row, None)
        if slot is None:
            return 0
        width = logical  # no (layer, head) holds more than the tokens appended
        ids = self.table.slot(slot, width)
        held = torch.arange(width, device=self.device) < self.lengths[slot][..., None]
        # the host mirror's sum (a host tensor, no device read) when it is exact and the entries all go to the free list
        count = int(self.host_lengths[slot].sum()) if exact and self.counts_releases else None
        self._give(ids, held, count)
        if count is None:
            self.mirror.mark()
        self.lengths[slot] = 0
        self.host_lengths[slot] = 0
        self.table.clear(slot)
        self._free_slots.append(slot)
        if not self.slot_of and self.table.grown:  # no row held: a table that grew past its reservation goes back
            self.table = RowTable(self.table.cap.shape[0], self.num_layers, self.num_kv_heads, self.table_columns,
                                  self.device, reserved=self.table_columns != self._default_columns)
        return count

    def clear(self) -> None:
        for row in self.rows:
            self.release(row)

    # ---- views (tests, readings) -----------------------------------------------------------------
    def prompt_scores(self, rows: list[int], window: int) -> torch.Tensor:
        """The stored scores of the entries of dense rows ``rows`` that a prompt decision would test (every position
        but the last ``window``), flat, on the device."""
        width = max(self.logical[r] for r in rows)
        slots = self.slots(rows)
        ids = self.table.gather(slots, width).to(torch.int64)
        tested = torch.arange(width, device=self.device) < self.lengths[slots][..., None] - window
        return torch.where(tested, self.scores[ids].float(), torch.nan).reshape(-1)

    def row_held(self, row: int) -> int:
        """Entries row ``row`` holds (the host mirror: exact once the snapshots of its decisions are applied)."""
        return int(self.lengths_host[self.slot_of[row]].sum()) if row in self.slot_of else 0

    def row_entries(self, row: int, layer: int, head: int) -> torch.Tensor:
        """int64 [n]: the entry ids of one (row, layer, head), in order."""
        if row not in self.slot_of:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        slot = self.slot_of[row]
        start = int(self.table.base_host[slot, layer, head])
        return self.table.data[start: start + int(self.lengths[slot, layer, head])].to(torch.int64)
