"""The records of a ``SharedRaggedStore``: which entries each engine slot's recorded token holds, in memory the pool
bounds.

An engine slot is one logical token of the engine's bookkeeping (SGLang: a slot id of its token allocator). Under
KVzap the engine holds more logical tokens than its pool has dense tokens (KVzap's freeing admits more requests), so
slot ids run past the pool's token count, by as much as the pruning frees. A record table indexed by slot id would
grow with them. A record, though, holds one entry per (layer, KV head) that no other record holds (the entries a
dense prefill computed for its token), and a recorded entry is never freed while its record lives: at most
``capacity // (layers · kv_heads)`` records (the pool's dense tokens) are alive at once, whatever the slot ids.

So the records live in a fixed table of that many rows, ``entries`` int32 [records + 1, L, H], and each slot has a
4-byte index into it, ``row_of`` int32 [slots + 1] (``rows``, the sink row, for a slot without a record; the
last slot is a sink too: every id outside the tables reads it). Record rows come from a free stack on the device
(``decode_decision.push`` / ``pop``), so adding and ending records reads nothing back: adding ``n`` records pops
``n`` rows (a number the host knows), ending them pushes the rows of the slots that had one (a count only the
device knows). Only ``row_of`` grows with the slot ids (by half at a time, a size the host knows); past
``reserve`` slots (the budget's reservation, ``integrations/sglang/ragged_budget.py``) the growth is logged once.
"""

from __future__ import annotations

import logging

import torch

from kvzap_export.kernels import decode_decision

log = logging.getLogger(__name__)


class SlotRecords:
    """Records of engine slots (module docstring): ``records`` rows for ``num_layers`` × ``num_kv_heads`` entry ids
    (``rows``; row ``rows`` is the sink), indexed by ``slots`` engine slot ids to start with (grown by ``ensure``)."""

    def __init__(self, records: int, slots: int, num_layers: int, num_kv_heads: int, device: torch.device):
        self.rows = max(records, 1)
        self.device = device
        self.entries = torch.zeros(self.rows + 1, num_layers, num_kv_heads, dtype=torch.int32, device=device)
        self.row_of = torch.full((max(slots, 1) + 1,), self.rows, dtype=torch.int32, device=device)
        self._free, self.top = decode_decision.full_stack(self.rows, device)  # the free record rows
        self.reserve: int | None = None  # slot ids a budget reserved the index for (growth past it is logged)

    @property
    def slot_count(self) -> int:
        """The engine slots the index covers (ids below this); its last row is the sink."""
        return self.row_of.shape[0] - 1

    def nbytes(self) -> int:
        size = lambda t: t.numel() * t.element_size()  # noqa: E731
        return size(self.entries) + size(self.row_of) + size(self._free) + size(self.top)

    def ensure(self, count: int) -> None:
        """An index for engine slot ids below ``count`` (grown by half at least, up to the reservation while ``count``
        is inside it; a number the host knows). The old and the new index are held together for the copy."""
        have = self.slot_count
        if count <= have:
            return
        size = max(count, have + have // 2)
        if self.reserve is not None and count <= self.reserve:
            size = min(size, self.reserve)  # no growth past the reservation before the slot ids need it
        if self.reserve is not None and size > self.reserve:
            log.warning("ragged KV store: the engine's slot ids reach %d, past the %d the record index's reservation "
                        "holds; the index grows to %d slots (4 bytes each)", count, self.reserve, size)
            self.reserve = None  # logged once
        row_of = torch.full((size + 1,), self.rows, dtype=torch.int32, device=self.device)
        row_of[:have] = self.row_of[:have]
        self.row_of = row_of

    def in_tables(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` (int64) with every id outside the index (negative, or past it) turned into the sink's."""
        return torch.where((slots >= 0) & (slots < self.slot_count), slots, self.slot_count)

    def has(self, safe: torch.Tensor) -> torch.Tensor:
        """bool, ``safe``'s shape: whether each slot (``in_tables``' output) holds a record."""
        return self.row_of[safe] != self.rows

    def ids(self, safe: torch.Tensor) -> torch.Tensor:
        """int32 [*safe.shape, L, H]: each slot's recorded entry ids (the sink row's, meaningless, without a record)."""
        return self.entries[self.row_of[safe].to(torch.int64)]

    def add(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """Records for ``slots`` (int64 [n], distinct, inside the index, none holding a record): their entry ids
        ``ids`` [n, L, H]. The caller guarantees the bound (every record's entries are its own: at most ``records``
        alive). On the device alone."""
        fresh = torch.empty(slots.shape[0], dtype=torch.int32, device=self.device)
        decode_decision.pop(self._free, self.top, fresh)
        self.entries[fresh.to(torch.int64)] = ids.to(torch.int32)
        self.row_of[slots] = fresh

    def end(self, safe: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Ends the records of ``safe[ends]`` (``in_tables``' output, each slot at most once where ``ends``, which
        only slots holding a record may be): their rows go back on the free stack and the slots hold none. Returns
        int64 [n, L·H]: their entry ids (where ``ends`` is False, whatever row the slot points at: the caller masks
        those). On the device alone."""
        rows = self.row_of[safe]
        ids = self.entries[rows.to(torch.int64)].reshape(safe.shape[0], -1).to(torch.int64)
        decode_decision.push(torch.where(ends, rows, -1), self._free, self.top)
        self.row_of[torch.where(ends, safe, self.slot_count)] = self.rows  # the sink slot keeps the sink row
        return ids

    def recorded_slots(self) -> torch.Tensor:
        """int64 [k]: the slots that hold a record (a host read: a slow path only)."""
        return torch.nonzero(self.row_of[:-1] != self.rows).reshape(-1)
