"""How many threads torch uses for each kind of work, so that validation degrades gracefully on a shared machine.

Measured on 2 shared cores (scripts/bench_main_command.py, docs/benchmarks.md): with two intra-op threads, every
small op (a decode step is hundreds of them, each tens of microseconds) ends in an OpenMP barrier; when another
process holds a core, one thread waits for the other (spinning first) and a 1-token step cost 3-7x the CPU time of
the same step on one thread, prefills 3-4x. One thread has no barrier to wait at. So validation runs torch on one
thread (``SMALL_WORK``), and only the LLM's prefill forwards, large matrix products that amortize the barriers,
use every core the process may use (``large_work_threads()``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

SMALL_WORK = 1


def large_work_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count inside the block, restored after it."""
    import torch

    previous = torch.get_num_threads()
    if count != previous:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)


@contextlib.contextmanager
def prefill_threads(llm) -> Iterator[None]:
    """Inside the block, each forward of ``llm`` that reads more than one new token per sequence (a prefill) runs on
    ``large_work_threads()``, every other forward (a decode step) on ``SMALL_WORK``; restored after the block.

    For generation loops we do not own (``llm.generate`` under kvpress's press): the thread count follows the work.
    """
    import torch

    previous = torch.get_num_threads()

    def choose(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        count = large_work_threads() if ids is not None and ids.shape[-1] > 1 else SMALL_WORK
        if torch.get_num_threads() != count:
            torch.set_num_threads(count)

    handle = llm.register_forward_pre_hook(choose, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)
