"""Allocator readings: what SGLang's own KV pools hold, per request at every step end, and at idle.

Opt-in with ``KVZAP_STATS=FILE`` (JSON lines, appended by every scheduler process: each line names its
``tp_rank`` and ``dp_rank``, the tensor-parallel rank and data-parallel replica, None without data parallelism;
under tensor parallelism each rank reads its own pools, which hold its own KV heads);
it works with KVzap on (any mode) and off (``KVZAP_BUNDLE`` unset: a dense SGLang's readings, the baseline
of the SGLang engine benchmark). The numbers come from the engine's pools, never from KVzap's decisions:

- ``slots_held``: token slots SGLang's allocator has handed out, ``size`` minus its free slot ids (one slot
  holds every layer and KV head of one token in the dense layout and evict mode; in ragged mode slot ids
  carry no K/V; with SGLang's radix cache on it includes the slots its tree keeps after their requests ended,
  ``tree_evictable_slots``); ``row_slots``: the request's slots by SGLang's bookkeeping (a prefix taken from the
  radix cache counts in every request that holds it) (``kv_allocated_len``, which
  evict mode itself lowers when it frees the tail); ``available_to_scheduler``: ``available_size()``;
- ragged mode: ``head_slots_held`` / ``head_slots_free`` (one-head entries, read from the store's free list; with the
  radix cache on, ``head_slots_cached``: entries only its tree holds, not counted in ``head_slots_held``)
  and ``row_head_slots`` (the lengths of the request's rows in the store's tables);
- ``bytes``: every buffer the mode allocated: SGLang's own K/V buffers (placeholders in ragged mode), its logical
  slot list, and what KVzap adds (the score side buffer; in ragged mode the pool's K, V, scores, row tables and
  free list).

``step_tokens``: the tokens this step computed for the request (an extend: its chunk, without the prefix SGLang
took from its radix cache or an earlier chunk; a decode step: 1). Per-request lines also carry what the glue's
decisions imply (``decided_entries``: the state's kept counts),
so that the two can be compared. Idle lines (``"event": "idle"``, written once each time the scheduler
runs out of work) show whether every entry came back (the no-leak check).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

ENV = "KVZAP_STATS"


class AllocatorReadings:
    """Appends JSON lines to ``path``."""

    def __init__(self, path: str | os.PathLike, tp_rank: int = 0, dp_rank: int | None = None):
        self.path = Path(path)
        self.where = {"tp_rank": tp_rank, "dp_rank": dp_rank}
        self._last_idle: dict | None = None

    @classmethod
    def from_env(cls, tp_rank: int = 0, dp_rank: int | None = None) -> "AllocatorReadings | None":
        path = os.environ.get(ENV)
        return cls(path, tp_rank, dp_rank) if path else None

    def _write(self, lines: list[dict]) -> None:
        """Appends ``lines`` in one write (several processes append to one file)."""
        if lines:
            data = "".join(json.dumps({**line, **self.where}) + "\n" for line in lines).encode()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)

    @staticmethod
    def pool(allocator, rt, tree=None) -> dict:
        """The pools' figures of one reading (module docstring)."""
        kv = allocator.get_kvcache()
        size = int(allocator.size)
        # SGLang's own free list of slot ids. In ragged mode the allocator's available_size() is the per-head
        # pool's room in dense tokens (what admission sees); the slot ids themselves carry no K/V there.
        free = allocator.logical_available() if hasattr(allocator, "logical_available") else allocator.available_size()
        out = {"pool_slots": size, "slots_held": size - int(free), "available_to_scheduler": int(allocator.available_size()),
               "layers": int(kv.layer_num), "kv_heads": int(kv.head_num),
               "bytes": {"sglang_kv": int(sum(kv.get_kv_size_bytes())), "slot_free_list": 8 * size,
                         **(rt.extra_bytes() if rt is not None else {})}}
        if tree is not None and not getattr(tree, "disable", True):
            # with SGLang's radix cache on, finished requests' slots stay in its tree (evictable, counted as room by
            # its admission), so slots_held counts them too
            out["tree_evictable_slots"] = int(tree.evictable_size())
        if rt is not None:
            out.update(rt.pool_readings(None))
        return out

    def record(self, batch, rt=None, extra: dict | None = None, scheduler=None) -> None:
        """One line per request of the batch, at the end of its step (right after its forward, before SGLang processes
        its result: under the overlap scheduler ``output_ids`` may then lack the previous step's token, so the length
        to read is ``logical_length`` where KVzap decided for the request, else ``seq_len``, SGLang's own length of the
        request in this forward, which evict mode lowers to what it kept); ``extra`` goes on every line
        (``host_reads``: the step's counted reads, ``host_reads.py``). ``scheduler``: its allocator and radix tree are
        read."""
        allocator = scheduler.token_to_kv_pool_allocator if scheduler is not None else batch.token_to_kv_pool_allocator
        pool = self.pool(allocator, rt, getattr(scheduler, "tree_cache", None))
        now, forward = time.time(), "extend" if batch.forward_mode.is_extend() else "decode"
        lines = []
        extend_lens = batch.extend_lens if forward == "extend" else None
        for i, req in enumerate(batch.reqs):
            idx = req.kv.req_pool_idx
            if idx is None:
                continue
            decided = rt.decided(idx) if rt is not None else {}
            line = {"rid": req.rid, "t": now, "forward": forward, "mode": rt.mode if rt is not None else "dense",
                    "kvzap": bool(decided), "decoding": decided.pop("decoding", None),
                    "prompt_tokens": len(req.origin_input_ids), "output_tokens": len(req.output_ids),
                    "step_tokens": int(extend_lens[i]) if extend_lens is not None else 1,
                    "seq_len": int(batch.seq_lens_cpu[i]),
                    "running_requests": len(batch.reqs), "row_slots": int(req.kv.kv_allocated_len), **pool, **decided}
            if rt is not None:
                line.update(rt.pool_readings(idx))
            line.update(extra or {})
            lines.append(line)
        self._write(lines)
        self._last_idle = None  # the next idle reading is written even if it equals the previous one

    def record_idle(self, scheduler, rt=None) -> None:
        """The pools with no request running; written once after each busy period (and when it changes)."""
        pool = self.pool(scheduler.token_to_kv_pool_allocator, rt, getattr(scheduler, "tree_cache", None))
        if pool != self._last_idle:
            self._last_idle = pool
            self._write([{"event": "idle", "t": time.time(), **pool}])
