"""One view of a per-head pool's room shared by tensor-parallel ranks (engine-independent: torch.distributed).

Under tensor parallelism each rank holds its own KV heads in its own ``RaggedStore``, so each frees a different number
of entries; an engine whose ranks schedule the same requests (SGLang: every rank runs the same scheduler on the same
inputs) needs one figure of room that is the same on every rank at every point it reads it, and that no rank's store
falls short of. ``RankRoom`` gives it:

- an **agreement** takes the least over ranks of each rank's room in tokens (free entries // entries per token, and
  the room with reclaimable entries counted), plus ``charged``;
- between agreements the figure falls by **charges**: what the engine's own bookkeeping takes, identical on every
  rank (tokens the engine allocates; a cached prefix set aside for an admission, charged at its token count, the most
  its soft entries can be, and refunded if the admission ends without taking it); frees are not counted until the
  next agreement. So ``room()`` is the same on every rank and
  never above any rank's own (the argument: docs/ragged-kv.md, "Tensor parallelism").

Costs: the step end starts an agreement without waiting (``start``: an asynchronous all-reduce on the ranks' CPU
group, which the engine's own per-step broadcast of new requests already uses); the next step end installs it
(``settle``), long finished by then. A blocking agreement (``agree``, ``agree_short``) runs only where the engine
acts on a short figure (it would evict, retract, or reclaim) and at a scheduler loop that ran no batch, at points
every rank reaches together because they follow from the shared figure. One rank (no group, or a group of one): every method is the local figure and costs nothing.
"""

from __future__ import annotations

import torch


class RankRoom:
    """The room every rank reports (module docstring). ``group``: a ``torch.distributed`` process group over the
    ranks (CPU/gloo), or None for one rank; ``start``: each rank's room at launch (tokens; the same on every rank)."""

    def __init__(self, group=None, start: int = 0):
        import torch.distributed as dist

        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.charged = [0, 0]  # tokens charged since launch against (free, room); the same on every rank
        self.agreed = [start, start]  # least over ranks of (local + charged) at the last installed agreement
        self._pending: tuple | None = None  # (work, tensor) of an agreement in flight
        self.dirty = False  # something changed since the last blocking agreement (the same on every rank)
        self.agreements = 0  # installed agreements (readings)
        self.blocking = 0  # of them blocking (readings: the slow path)

    @property
    def shared(self) -> bool:
        return self.size > 1

    # ---- identical bookkeeping ---------------------------------------------------------------------
    def charge(self, tokens: int, free: bool = True) -> None:
        """The engine took ``tokens`` (``free``: entries from the free list; otherwise only room, e.g. a prefix set
        aside for an admission)."""
        if tokens:
            self.charged[1] += tokens
            if free:
                self.charged[0] += tokens
            self.dirty = True

    def refund(self, tokens: int) -> None:
        """Gives back a room-only charge whose cause ended without taking anything (an admission's prefix set aside,
        then let go without an adoption: each rank's own room is back too)."""
        if tokens:
            self.charged[1] -= tokens
            self.dirty = True

    def touched(self) -> None:
        """Something the next idle agreement must see changed (a release, a decision), at a point every rank reaches."""
        self.dirty = True

    # ---- the shared figures ------------------------------------------------------------------------
    def room(self, local: int) -> int:
        """Tokens of room every rank has: ``local`` (this rank's) with one rank."""
        return local if not self.shared else self.agreed[1] - self.charged[1]

    def free(self, local: int) -> int:
        """Tokens of free entries every rank has (``local``: this rank's, counted like ``room``'s)."""
        return local if not self.shared else self.agreed[0] - self.charged[0]

    # ---- agreements --------------------------------------------------------------------------------
    def _launch(self, free: int, room: int, wait: bool):
        import torch.distributed as dist

        t = torch.tensor([free + self.charged[0], room + self.charged[1]], dtype=torch.int64)
        work = dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group, async_op=not wait)
        return work, t

    def _install(self, t: torch.Tensor) -> None:
        self.agreed = [int(t[0]), int(t[1])]
        self.agreements += 1

    def settle(self) -> None:
        """Installs the agreement in flight, if any (waits for it: started a step ago, it has finished)."""
        if self._pending is not None:
            work, t = self._pending
            self._pending = None
            work.wait()
            self._install(t)

    def start(self, free: int, room: int) -> None:
        """At a step end, every rank: installs the previous agreement and starts the next with this rank's figures
        (lower bounds are fine: the least over ranks stays a bound)."""
        if not self.shared:
            return
        self.settle()
        self._pending = self._launch(free, room, wait=False)
        self.dirty = True

    def agree(self, free: int, room: int) -> None:
        """A blocking agreement on this rank's current figures, at a point every rank reaches together."""
        if not self.shared:
            return
        self.settle()
        _, t = self._launch(free, room, wait=True)
        self._install(t)
        self.blocking += 1
        self.dirty = False

    def agree_short(self, free: int, room: int, short: int) -> int:
        """One blocking all-reduce that both agrees (as ``agree``) and returns the most any rank is ``short`` of (the
        slow path of an allocation; every rank calls it at the same point)."""
        if not self.shared:
            return short
        import torch.distributed as dist

        self.settle()
        t = torch.tensor([free + self.charged[0], room + self.charged[1], -short], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        self._install(t)
        self.blocking += 1
        return -int(t[2])

    def most(self, value: int) -> int:
        """The largest ``value`` over ranks (blocking; the slow path, at a point every rank reaches together)."""
        if not self.shared:
            return value
        import torch.distributed as dist

        self.settle()
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t[0])
