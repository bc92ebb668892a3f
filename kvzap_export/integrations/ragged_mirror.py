"""The host's view of a ``RaggedStore``'s device state, learned without waiting for the device.

A decision (``decide_prefill`` / ``decide_decode``) and a release run on the device alone: they shrink rows, push freed
entries on the free stack (``top``, a device tensor) and, in a ``SharedRaggedStore``, count entries that turned soft
(``soft_counter``). Reading those counts back would stall a GPU's stream at every step, so such work only marks what
the host no longer knows (``mark``). The next time the host needs its figures (``HostMirror.sync``, at the start of the
store's host-side work: an admission's ``available``, the next step's layout) it takes one **snapshot** of all of it:
one device -> host copy of the top, the soft count and the marked rows' lengths, into pinned memory, non-blocking, with
an event (on the CPU the copy is the values themselves), and applies every snapshot whose event has completed. So the
host learns what it needs at most once per step and never waits for it, except when a lower bound is too low to go on
(``HostMirror.wait``: an allocation that the mirrored free count cannot cover).

Until then the host's figures are bounds that keep the engine safe: the free count a lower bound (device-only pushes
not counted yet), and so the free and soft counts' sum (an end of records, ``SharedRaggedStore.drop_records``, turns
soft entries free: the soft count alone may be high by as many), a row's mirrored lengths an upper bound (decisions
only shrink rows; appends are counted on the host at once). Applying a snapshot adds what the host did itself after it was taken (its pops,
its pushes of known size, its known soft changes, the tokens appended to each row) to the snapshot's values.
Snapshots are applied in order, so a later one never goes back behind an earlier one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch


@dataclass
class Snapshot:
    values: torch.Tensor  # int32 on the host: top, soft, then the lengths table [slots, L, H] when rows were marked
    rows: list[tuple[int, int, int, int]]  # (request row, table slot, its incarnation, its logical length then)
    known: tuple[int, int, int]  # the host's pops, pushes and soft changes when it was taken
    event: object | None  # a CUDA event recorded after the copy (None: the values are there already)


class _HeldCopy:
    """A CPU snapshot standing in for a GPU's copy that has not arrived (``HostMirror.held_copies``, tests)."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class HostMirror:
    """The host-side counters of a store (module docstring): ``top`` and ``soft`` are the host's bounds, ``pops``,
    ``pushes`` and ``soft_known`` what the host changed itself. ``held_copies`` (tests): CPU snapshots behave as a
    GPU's that have not arrived yet, until something waits for them (``wait``), so the CPU runs the bounds' path."""

    held_copies = False

    def __init__(self, store, top: int):
        self.store = store
        self.top, self.soft = top, 0
        self.pops = self.pushes = self.soft_known = 0
        self.incarnation: dict[int, int] = {}  # request row -> how many times it took a table slot
        self._taken = 0
        self._pending: deque[Snapshot] = deque()
        self._last: dict[int, int] = {}  # request row -> the number of its latest snapshot
        self._made = self._applied = 0
        self._marked: set[int] = set()  # rows whose lengths changed on the device since the last snapshot
        self._dirty = False  # the device's top or soft count changed by a number the host does not know

    # ---- the host's own changes ----------------------------------------------------------------
    def popped(self, n: int) -> None:
        self.top -= n
        self.pops += n

    def pushed(self, n: int) -> None:
        """``n`` entries pushed whose number the host knows."""
        self.top += n
        self.pushes += n

    def soft_changed(self, n: int) -> None:
        """The soft count changed by ``n`` (known on the host); the store's device counter changes with it."""
        self.soft += n
        self.soft_known += n

    def took_slot(self, row: int) -> None:
        self._taken += 1
        self.incarnation[row] = self._taken

    def dropped(self, row: int) -> None:
        self.incarnation.pop(row, None)
        self._last.pop(row, None)
        self._marked.discard(row)

    def exact(self, row: int) -> bool:
        """Whether the host's mirror of ``row``'s lengths is exact (no device change of it unlearnt)."""
        return row not in self._marked and self._last.get(row, 0) <= self._applied

    def mark(self, rows=()) -> None:
        """Device-only work changed the top or the soft count, and the lengths of ``rows``."""
        self._dirty = True
        self._marked.update(rows)

    # ---- snapshots -----------------------------------------------------------------------------
    def _take(self) -> None:
        """One non-blocking copy of what the marks say the host does not know: the top, the soft count and, when rows
        are marked, the whole lengths table (int32 [slots, L, H]: a few hundred KB at most, no upload of the rows'
        slots needed)."""
        store = self.store
        rows = sorted(self._marked)
        self._marked.clear()
        self._dirty = False
        parts = [store.top.to(torch.int32), store.soft_counter.to(torch.int32)]
        if rows:
            parts.append(store.lengths.reshape(-1))
        flat = torch.cat(parts)
        event = None
        if flat.is_cuda:
            host = torch.empty(flat.shape, dtype=torch.int32, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            flat = host
        elif self.held_copies:
            event = _HeldCopy()
        self._made += 1
        for r in rows:
            self._last[r] = self._made
        self._pending.append(Snapshot(flat, [(r, store.slot_of[r], self.incarnation[r], store.logical[r]) for r in rows],
                                      (self.pops, self.pushes, self.soft_known), event))

    def sync(self) -> None:
        """Takes a snapshot if something is marked, then applies every snapshot whose copy has completed, in order
        (never waits)."""
        if self._dirty:
            self._take()
        while self._pending and (self._pending[0].event is None or self._pending[0].event.query()):
            self._apply(self._pending.popleft())

    def wait(self) -> None:
        """Takes a snapshot if something is marked and applies every snapshot, waiting for their copies: the host's
        figures are then exact."""
        if self._dirty:
            self._take()
        while self._pending:
            snapshot = self._pending.popleft()
            if snapshot.event is not None:
                snapshot.event.synchronize()
            self._apply(snapshot)

    def _apply(self, s: Snapshot) -> None:
        store = self.store
        top, soft = s.values[:2].tolist()
        pops, pushes, soft_known = s.known
        self.top = top - (self.pops - pops) + (self.pushes - pushes)
        self.soft = soft + (self.soft_known - soft_known)
        self._applied += 1
        current = [(slot, store.logical[row] - logical) for row, slot, inc, logical in s.rows
                   if self.incarnation.get(row) == inc]
        if current:
            L, H = store.num_layers, store.num_kv_heads
            slots, grown = (torch.tensor(column) for column in zip(*current))
            lengths = s.values[2:].view(-1, L, H).to(torch.int64)
            store.host_lengths[slots] = lengths[slots] + grown[:, None, None]
