"""Per-head storage with prefixes shared between requests (an engine's prefix cache over a ``RaggedStore``).

Engine-independent (pure torch). SGLang's ragged mode uses it when its radix cache is on
(``integrations/sglang/ragged_radix.py``); the exactness argument is in docs/ragged-kv.md ("Radix cache in ragged
mode").

What it adds to ``RaggedStore``:

- **records**: an engine slot (one logical token of the engine's own bookkeeping) whose token a dense prefill
  computed keeps that token's full entries, one per (layer, KV head), in ``records`` (``slot_records.py``: a table
  the pool bounds, and a 4-byte index per slot id). A record outlives the request that computed it for as long as
  the engine holds the slot (its prefix cache); a later request whose prompt starts with the same tokens adopts the
  records into its own row instead of computing them again, and then decides on every entry as its own prompt's;
- **reference counts**: ``rowref`` int32 [capacity + 1] counts the rows that hold an entry, ``recorded`` marks
  the entries a record holds. An entry goes back to the free list when neither holds it. An entry a record holds
  and no row does is **soft** (``soft``: how many; counted on the device, learned by the host like the free count,
  ``ragged_mirror.py``): the decisions of every request that read
  it evicted it. Soft entries are room: ``reclaimable`` counts them, and ``drop_records`` turns a record's soft
  entries back into free ones (the engine then knows that record's token no longer holds a full prefix).

Only tokens computed by a dense prefill over a dense row are recorded (``record``): a token decoded, or computed
over a pruned row, has other hidden states than kvpress would give it as a prompt token.
"""

from __future__ import annotations

import torch

from kvzap_export.errors import InputError
from kvzap_export.integrations.ragged_store import RaggedStore, upload
from kvzap_export.integrations.slot_records import SlotRecords

DROP_CHUNK = 1 << 20  # entries per chunk of ``drop_records`` (its scratch: a few tens of bytes per entry)


class SharedRaggedStore(RaggedStore):
    """A ``RaggedStore`` whose entries rows and engine slots can share (module docstring)."""

    moves_kept = False  # records and other rows refer to entry ids: a decision never moves an entry
    counts_releases = False  # a release's entries may turn soft instead of free: the host learns the count later

    def __init__(self, capacity: int, num_layers: int, num_kv_heads: int, head_dim: int, v_head_dim: int | None = None,
                 *, slots: int = 16, **kwargs):
        super().__init__(capacity, num_layers, num_kv_heads, head_dim, v_head_dim, **kwargs)
        self.rowref = torch.zeros(capacity + 1, dtype=torch.int32, device=self.device)
        self.recorded = torch.zeros(capacity + 1, dtype=torch.bool, device=self.device)
        # at most one record per dense token of the pool is alive (slot_records.py); ``slots``: the index to start with
        dense_tokens = capacity // (num_layers * num_kv_heads)
        self.records = SlotRecords(dense_tokens, slots, num_layers, num_kv_heads, self.device)
        self.dense_len: dict[int, int] = {}  # request row -> its leading logical positions whose tokens are recorded
        self.adopted: dict[int, int] = {}  # request row -> tokens it adopted, until the engine's step end reads it
        # callable(short, extra=0): frees at least ``short`` more entries, and ``extra`` more where the engine's cache
        # has unused prefixes to evict (the engine's prefix cache)
        self.reclaimer = None
        self.reclaimed_nodes = 0  # cached prefixes whose soft entries a reclaim took back (the engine's count)
        self.reclaims = 0  # allocations that found too few free entries and took soft ones back (the engine's count)
        self.dropped_prompts = 0  # rows whose records ``drop_unanchored`` ended before the engine cached them
        self.held_requests = 0  # waiting requests the engine's glue held for a prefill in flight (SGLang: ragged_radix)
        # node of the engine's prefix cache on a path a request was admitted with -> its soft entries, until the
        # allocation that adopts them: they are not room (the adoption makes them the row's), though soft until then
        # (``set_aside``; kept current when a row lets go of some of them in between: ``_give``)
        self.pending: dict[int, int] = {}
        self.pending_slots: dict[int, torch.Tensor] = {}  # the same nodes -> their slots
        self.aside_charged: dict[int, int] = {}  # tensor parallelism: the same nodes -> the tokens charged (``ranks``)
        # request row -> (position, slots): the row's records from ``position`` on, which the engine's prefix cache has
        # not taken yet (``anchored``). Under an overlap scheduler the engine inserts a prompt into its cache a step
        # after the step end recorded it, and admits requests in between: their soft entries are room, and only
        # ``drop_unanchored`` (not the cache's own eviction) can take them back then
        self.unanchored: dict[int, tuple[int, torch.Tensor]] = {}

    # ---- accounting --------------------------------------------------------------------------------
    @property
    def soft(self) -> int:
        """Entries a record holds and no row does (``soft_counter`` on the device; on the host, until the snapshots
        of earlier decisions, releases and ends of records are applied, low by the entries those turned soft and high
        by those ends of records freed: ``available + soft`` is a lower bound of the room, like ``available``)."""
        self.mirror.sync()
        return max(self.mirror.soft, 0)

    def _soft_change(self, n: int) -> None:
        """``n`` entries (known on the host) stopped (n < 0) or started being soft."""
        if n:
            self.mirror.soft_changed(n)
            self.soft_counter.add_(n)

    @property
    def reclaimable(self) -> int:
        """Entries an allocation can get: the free ones and the soft ones (``drop_records`` frees those), less the
        soft ones admitted requests are about to adopt (``pending``)."""
        return self.available + self.soft - sum(self.pending.values())

    def set_aside(self, nodes: dict[int, torch.Tensor]) -> None:
        """An admission on ``nodes`` (key -> the node's slots): their soft entries stop being room until
        ``clear_aside`` (the allocation that adopts them). One read of the device."""
        for key, slots, soft in zip(nodes, nodes.values(), self.soft_per_group(list(nodes.values()))):
            self.pending[key], self.pending_slots[key] = soft, slots
        if self.ranks is not None:  # the most a node's soft entries can be, in tokens: its own (the same on every rank)
            new = {key: int(slots.numel()) for key, slots in nodes.items() if key not in self.aside_charged}
            self.ranks.charge(sum(new.values()), free=False)
            self.aside_charged.update(new)

    def unset_aside(self, key: int) -> None:
        """The last admission on node ``key`` ended without an adoption: its soft entries are room again."""
        self.pending.pop(key, None)
        self.pending_slots.pop(key, None)
        if self.ranks is not None:
            self.ranks.refund(self.aside_charged.pop(key, 0))

    def clear_aside(self) -> None:
        """The admitted requests adopted what their admissions set aside."""
        self.pending.clear()
        self.pending_slots.clear()
        self.aside_charged.clear()  # adopted: the rows now hold what the charges stood for

    def nbytes(self) -> dict[str, int]:
        size = lambda t: t.numel() * t.element_size()  # noqa: E731
        out = super().nbytes()
        out["sharing"] = size(self.rowref) + size(self.recorded)
        out["slot_records"] = self.records.nbytes()
        return out

    def append(self, rows: list[int], counts: list[int]) -> torch.Tensor:
        per_token = self.num_layers * self.num_kv_heads
        need = per_token * sum(counts)
        ranks = self.ranks
        if ranks is not None and ranks.shared:
            # tensor parallelism: every rank reclaims the same way or none does, since a reclaim changes the engine's
            # prefix cache, which the ranks share. The shared free figure (this allocation already charged) says
            # whether any rank may be short; only then do they agree (blocking), learning the most any rank is short
            # of, and reclaim that, evicting as much again of the cache's unused prefixes where it has them (the next
            # allocations then find room without this path).
            if ranks.free(0) < 0:
                self.exact()
                tokens = sum(counts)
                short = ranks.agree_short((self.available - need) // per_token, (self.reclaimable - need) // per_token,
                                          -(-max(need - self.available, 0) // per_token))
                if short and self.reclaimer is not None:
                    self.reclaimer(short * per_token, tokens * per_token)
        elif need > self.available:
            self.exact()  # the host's free count is a lower bound: learn the exact one before taking anything back
            if need > self.available and self.reclaimer is not None:  # soft entries were counted as room: take them back
                self.reclaimer(need - self.available)
        return super().append(rows, counts)

    def _take(self, n: int) -> torch.Tensor:
        new = super()._take(n)
        self.rowref[new] = 1
        return new

    def _give(self, ids: torch.Tensor, mask: torch.Tensor, count: int | None = None) -> None:
        """Rows let go of ``ids[mask]``: each loses a reference; entries no row and no record holds are freed,
        entries only a record holds become soft. On the device alone (the caller takes the snapshot): two rows may let
        go of one entry in one call, so the entries that reached 0 are sorted and each pushed once."""
        ids, mask = ids.reshape(-1).to(torch.int64), mask.reshape(-1)
        if ids.numel() == 0:
            return
        self.rowref.index_add_(0, ids, -mask.to(torch.int32))
        beyond = self.capacity + 1  # sorts after every entry id: not an entry that reached 0
        zero = torch.sort(torch.where(mask & (self.rowref[ids] == 0), ids, beyond)).values
        once = (zero < beyond) & firsts(zero)
        zero = zero.clamp(max=self.capacity)
        soft = once & self.recorded[zero]
        self.soft_counter.add_(soft.sum())
        super()._give(zero, once & ~soft)
        if self.pending:
            # a row let go between an admission and its adoption (SGLang's priority preemption: the admitted request
            # will adopt what the preempted one held): what is set aside is each admitted node's soft entries now
            self.set_aside(dict(self.pending_slots))

    def release(self, row: int) -> int:
        self.dense_len.pop(row, None)
        self.adopted.pop(row, None)
        self.unanchored.pop(row, None)  # the engine frees or caches its slots (``drop_records`` for the freed ones)
        return super().release(row)

    # ---- records -------------------------------------------------------------------------------------
    @property
    def slot_count(self) -> int:
        """The engine slots the records' index covers (ids below this)."""
        return self.records.slot_count

    def record(self, rows: list[int], counts: list[int], slots: torch.Tensor, new_ids: torch.Tensor,
               exclude: set[int] = frozenset(), *, slots_below: int | None = None) -> int:
        """After a prefill forward: the engine slots ``slots`` [T] of its tokens (in the order of ``new_ids``
        [L, H, T], ``append``'s result for ``rows`` / ``counts``) keep their tokens' entries. Only the tokens of a row
        that was dense before this forward and is still dense (no decision yet) and whose earlier tokens are all
        recorded get records (module docstring); rows in ``exclude`` get none (the engine will never cache them).
        ``slots_below``: a bound the host knows of the engine's slot ids, exclusive (every id < it; SGLang: its
        allocator's size + 1); without it the largest of ``slots`` is read from the device. With it, no host read.
        Returns the tokens recorded."""
        ok, where, start = [], [], 0
        slots = slots.to(self.device, torch.int64)
        for r, n in zip(rows, counts):
            dense = r in self.slot_of and r not in self.decided  # no decision has tested it: it holds every token
            ok.append(n > 0 and dense and r not in exclude and self.dense_len.get(r, 0) == self.logical[r] - n)
            if ok[-1]:
                self.dense_len[r] = self.logical[r]
                at, before = self.unanchored.get(r, (self.logical[r] - n, slots[:0]))
                self.unanchored[r] = (at, torch.cat([before, slots[start:start + n]]))
                where.append(torch.arange(start, start + n))
            start += n
        kept = sum(n for n, k in zip(counts, ok) if k)
        if not kept:
            return 0
        if kept < start:
            picked = upload(self.device, torch.cat(where))[0]
            slots, new_ids = slots[picked], new_ids[..., picked]
        self.records.ensure(slots_below if slots_below is not None else int(slots.max()) + 1)
        self.drop_records(slots)  # a slot is recorded once (the engine reuses a slot only after freeing it)
        self.records.add(slots, new_ids.permute(2, 0, 1))
        self.recorded[new_ids.reshape(-1)] = True
        return kept

    def drop_records(self, slots: torch.Tensor) -> None:
        """The engine let go of ``slots`` (or gives up their records to reclaim memory): their records end, and
        entries no row holds (soft ones) are freed. Slots without a record are ignored, a slot named twice ends once.
        On the device alone, like a decision: the host learns the entries freed from its next snapshot (until then
        its free count is low and its soft count high by as many: their sum, the room, is unchanged). In chunks of
        about ``DROP_CHUNK`` entries, so that a large free (a long request's slots, a flush) takes bounded scratch."""
        if slots.numel() == 0:
            return
        slots = torch.sort(slots.reshape(-1).to(self.device, torch.int64)).values
        step = max(1, DROP_CHUNK // (self.num_layers * self.num_kv_heads))
        for start in range(0, slots.shape[0], step):  # a slot split over two chunks: the first ends it
            self._drop_sorted(slots[start: start + step])
        self.mirror.mark()

    def _drop_sorted(self, slots: torch.Tensor) -> None:
        """``drop_records`` of sorted slot ids, on the device."""
        slots = self.records.in_tables(slots)
        ends = firsts(slots) & self.records.has(slots)
        spare = self.capacity  # the entry index past the pool: never recorded, never held
        ids = torch.where(ends[:, None], self.records.end(slots, ends), spare)
        self.recorded[ids] = False
        free = ends[:, None] & (self.rowref[ids] == 0)
        self.soft_counter.sub_(free.sum())
        RaggedStore._give(self, ids, free)

    def anchored(self, row: int, length: int) -> None:
        """The engine's prefix cache now holds row ``row``'s first ``length`` tokens: their records are its to evict."""
        if row in self.unanchored:
            at, slots = self.unanchored[row]
            if length >= at + int(slots.numel()):
                del self.unanchored[row]
            elif length > at:
                self.unanchored[row] = (length, slots[length - at:])

    def drop_unanchored(self, short: int | None = None) -> int:
        """Ends records the engine's prefix cache has not taken yet (running prompts recorded a step ago, under an
        overlap scheduler): those of the rows holding the most soft entries first, until ``short`` entries are freed
        (None: every row with a soft entry). A dropped row's recorded length falls back to where those records began,
        so the engine will not cache those tokens; rows whose records hold no soft entry keep them. Under tensor
        parallelism (``ranks``) every rank drops the same rows: in row order, as many as the rank that needs most.
        Reads the device once (the soft entries per row). Returns the entries freed."""
        rows = list(self.unanchored)
        soft = self.soft_per_group([self.unanchored[r][1] for r in rows])
        if self.ranks is not None and self.ranks.shared:
            order = sorted(range(len(rows)), key=lambda i: rows[i])
            picked = order[: self.ranks.most(leading(soft, order, short))]
        else:
            picked, _ = take_soft(soft, sorted(range(len(rows)), key=lambda i: -soft[i]), short)
        chosen = [rows[i] for i in picked]
        if not chosen:
            return 0
        self.drop_records(torch.cat([self.unanchored[r][1] for r in chosen]))
        for row in chosen:
            self.dense_len[row] = self.unanchored.pop(row)[0]
        self.dropped_prompts += len(chosen)
        return sum(soft[i] for i in picked)  # a record's soft entries are what its end frees

    def soft_per_group(self, groups: list[torch.Tensor]) -> list[int]:
        """For each group of slots, the entries of their records no row holds (``soft_per_slot`` summed), in one read
        of the device."""
        if not groups:
            return []
        sizes = torch.tensor([int(g.numel()) for g in groups])
        owner = torch.repeat_interleave(torch.arange(len(groups)), sizes)
        soft = self.soft_per_slot(torch.cat(groups))
        return torch.zeros(len(groups), dtype=torch.int64).index_add_(0, owner, soft).tolist()

    def soft_per_slot(self, slots: torch.Tensor) -> torch.Tensor:
        """int64 [n] on the host: for each slot, the entries of its record no row holds (0 without a record)."""
        slots = slots.reshape(-1).to(self.device, torch.int64)
        if slots.numel() == 0:
            return torch.zeros(0, dtype=torch.int64)
        safe = self.records.in_tables(slots)
        ids = self.records.ids(safe).reshape(slots.numel(), -1).to(torch.int64)
        soft = (self.rowref[ids] == 0).sum(-1) * self.records.has(safe)
        return soft.to("cpu", torch.int64)

    def adopt(self, row: int, slots: torch.Tensor) -> None:
        """``adopt_all`` for one row."""
        self.adopt_all({row: slots})

    def adopt_all(self, prefixes: dict[int, torch.Tensor]) -> None:
        """New request rows start with the recorded tokens of engine slots (row -> its slots [p]; every one must have
        a record): each row holds their entries (shared, one more reference each), as if it had computed them. One
        read of the device for all the rows: the check that every slot holds a record, and the entries that stop
        being soft (counted once when two rows adopt one). A failed check changes nothing."""
        for row in prefixes:
            if row in self.slot_of or self.logical.get(row, 0):
                raise InputError(f"adopt: row {row} already holds entries (only a new request adopts a prefix)")
        prefixes = {row: slots.reshape(-1).to(self.device, torch.int64) for row, slots in prefixes.items()
                    if slots.numel()}
        if not prefixes:
            return
        safe = {row: self.records.in_tables(slots) for row, slots in prefixes.items()}
        flat = torch.cat([self.records.ids(s).reshape(-1) for s in safe.values()]).to(torch.int64)
        once = torch.sort(flat).values
        stop_soft = (firsts(once) & (self.rowref[once] == 0)).sum()
        *recorded, soft = torch.stack([self.records.has(s).all().to(torch.int64) for s in safe.values()]
                                      + [stop_soft]).tolist()
        for (row, slots), ok in zip(prefixes.items(), recorded):
            if not ok:
                raise RuntimeError(f"ragged KV store: row {row} adopts {slots.numel()} slots and some hold no record "
                                   "(the prefix cache matched a prefix that was not recorded)")
        self._ensure_rows(len(self.slot_of) + len(prefixes))
        counts = [int(slots.numel()) for slots in safe.values()]
        table = []  # the rows' table slots
        for row, p in zip(safe, counts):
            slot = self.slot_of[row] = self._free_slots.pop()
            self.mirror.took_slot(row)
            table.append(slot)
            self.host_lengths[slot] = p
            self.logical[row] = self.dense_len[row] = self.adopted[row] = p
        B, width = len(table), max(counts)
        padded = torch.full((B, width), self.slot_count, dtype=torch.int64, device=self.device)  # the sink: masked
        for b, slots in enumerate(safe.values()):
            padded[b, : slots.numel()] = slots
        host_counts = torch.tensor(counts)
        self._columns(torch.tensor(table), host_counts[:, None, None].expand(B, self.num_layers, self.num_kv_heads))
        table_dev, counts_dev = upload(self.device, torch.tensor(table), host_counts)
        valid = torch.arange(width, device=self.device) < counts_dev[:, None]  # [B, width]
        self.table.write(table_dev, self.records.ids(padded).permute(0, 2, 3, 1),
                         valid[:, None, None, :].expand(B, self.num_layers, self.num_kv_heads, width))
        self.lengths[table_dev] = counts_dev[:, None, None].to(self.lengths.dtype)
        self._soft_change(-soft)
        self.rowref.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))

    def clear_records(self) -> None:
        """The engine let go of every slot (a cache flush: a slow path, one read for the recorded slots)."""
        self.drop_records(self.records.recorded_slots())


def firsts(ordered: torch.Tensor) -> torch.Tensor:
    """bool [n]: where a sorted 1-d tensor's value differs from the one before it (each value's first place)."""
    return torch.cat([ordered.new_ones(1, dtype=torch.bool), ordered[1:] != ordered[:-1]])


def take_soft(soft: list[int], order, need: int | None) -> tuple[list[int], int]:
    """What a reclaim takes: the indices of ``soft`` (entries each group's records would free), in ``order``, that free
    anything, until they free ``need`` entries (None: all of them). Returns (indices, entries they free)."""
    chosen, gained = [], 0
    for i in order:
        if need is not None and gained >= need:
            break
        if soft[i]:
            chosen.append(i)
            gained += soft[i]
    return chosen, gained


def leading(soft: list[int], order, need: int | None) -> int:
    """How many of ``order``'s first indices of ``soft`` free ``need`` entries (None, or never enough: all of them):
    under tensor parallelism the ranks take the same leading groups, as many as the rank that needs most."""
    order, gained = list(order), 0
    for k, i in enumerate(order):
        if need is not None and gained >= need:
            return k
        gained += soft[i]
    return len(order)
