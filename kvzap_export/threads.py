"""How many threads torch uses for each kind of work, so that validation degrades gracefully on a shared machine.

Measured on 2 shared cores (scripts/bench_main_command.py, docs/benchmarks-history.md): with two intra-op threads, every
small op (a decode step is hundreds of them, each tens of microseconds) ends in an OpenMP barrier; when another
process holds a core, one thread waits for the other (spinning first) and a 1-token step cost 3-7x the CPU time of
the same step on one thread, prefills 3-4x. One thread has no barrier to wait at. So validation runs torch on one
thread (``SMALL_WORK``), and only the LLM's prefill forwards, large matrix products that amortize the barriers,
use every core the process may use (``large_work_threads()``).

Independent runs of the LLM (the model level's three greedy runs) go side by side instead (``side_by_side``): each in
its own Python thread with torch on one intra-op thread, so no OpenMP barrier is shared and every core has work. A
decode step streams the weights once through small-row matrix products and pays per-op overhead; one thread neither
saturates memory nor gains much from a second thread (docs/benchmarks-history.md: 5-row products at about half a core's
peak, 11 GB/s of memory reads per core), so two or three runs at once keep both cores busy, and prefills fill both.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

from kvzap_export.resources import usable_cores  # affinity capped by a cgroup CPU quota; side_by_side looks it up here

SMALL_WORK = 1
T = TypeVar("T")
_worker = threading.local()  # ``cores``: in a ``side_by_side`` job, the cores that job may use


class Stopped(Exception):
    """Raised inside a side-by-side job (``stop_point``) once another job failed or the caller was interrupted."""


def large_work_threads() -> int:
    """Every core the process may use; inside a ``side_by_side`` job, that job's share of them."""
    return getattr(_worker, "cores", None) or usable_cores()


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


def side_by_side(jobs: Sequence[Callable[[threading.Event], T]], together: bool = True) -> list[T]:
    """Runs ``jobs`` at once, each in its own thread, and returns their results in order.

    Each job's share of the cores (``large_work_threads()`` in it) is ``usable_cores() // len(jobs)``, at least one:
    on 2 cores, three jobs each run torch on one thread and the OS shares the cores among them, with no OpenMP barrier
    between jobs. Its torch starts at ``SMALL_WORK`` threads (``prefill_threads`` raises it for prefills).

    Each job gets a ``threading.Event`` that is set once another job failed or the caller was interrupted
    (KeyboardInterrupt): a job calls ``stop_point(event)`` where it can stop (``stop_hooks`` puts one before every
    decoder layer of a model). After every job has ended (nothing keeps running behind it) the first job's error is
    raised (in job order; a ``Stopped`` only when no job failed otherwise), with any other job's error noted on it.
    On a single core, or with ``together=False``, the jobs run one after the other, in the caller's thread.
    """
    stop = threading.Event()
    cores = usable_cores()
    if not together or cores == 1 or len(jobs) == 1:
        return [job(stop) for job in jobs]
    share = max(1, cores // len(jobs))

    import torch

    def one_thread(job):
        _worker.cores = share
        # Per thread: OpenMP's and MKL's counts. Process-wide: the count a thread's first parallel region starts
        # with and the pthreadpool size; the caller sets them back to its own count once the jobs have ended.
        torch.set_num_threads(SMALL_WORK)
        try:
            return job(stop)
        except BaseException:
            stop.set()  # the other jobs stop at their next stop point
            raise

    caller_threads = torch.get_num_threads()
    futures = []
    try:
        with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="kvzap-side-by-side") as pool:
            try:
                futures.extend(pool.submit(one_thread, job) for job in jobs)
                wait(futures)
            except BaseException:  # KeyboardInterrupt here: stop the jobs, let them end, then raise it
                stop.set()
                wait(futures)
                raise
    finally:
        torch.set_num_threads(caller_threads)
    errors = [future.exception() for future in futures if future.exception() is not None]
    if errors:  # the error that stopped the others, not the ``Stopped`` it caused in them; the others noted on it
        first = next((e for e in errors if not isinstance(e, Stopped)), errors[0])
        for other in errors:
            if other is not first and not isinstance(other, Stopped) and hasattr(first, "add_note"):
                first.add_note(f"another run failed too: {type(other).__name__}: {other}")
        raise first
    return [future.result() for future in futures]


def stop_point(stop: threading.Event) -> None:
    if stop.is_set():
        raise Stopped("stopped: another run failed or the command was interrupted")


@contextlib.contextmanager
def stop_hooks(modules, stop: threading.Event | None) -> Iterator[None]:
    """A ``stop_point`` before each forward of ``modules`` (e.g. the decoder layers: a prefill stops within a layer);
    nothing when ``stop`` is None."""
    handles = [] if stop is None else [module.register_forward_pre_hook(lambda *_: stop_point(stop)) for module in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
