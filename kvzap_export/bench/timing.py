"""Wall-clock timing that is honest on shared, noisy machines: warm up, repeat, report the median."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def measure(fn: Callable[[], object], min_seconds: float = 0.3, min_repeats: int = 3, max_repeats: int = 200,
            sync: Callable[[], None] | None = None, warmup: bool = True) -> dict[str, float]:
    """Median and min seconds per call of ``fn`` (after one warm-up call unless ``warmup=False``)."""
    if warmup:
        fn()
        if sync:
            sync()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_repeats or (time.perf_counter() - start < min_seconds and len(times) < max_repeats):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "repeats": len(times)}


def measure_cuda(fn: Callable[[], object], repeats: int = 15, target_s: float = 2e-3, max_inner: int = 50) -> dict[str, float]:
    """Median seconds per call of ``fn`` on the current CUDA stream, by CUDA events around ``inner`` back-to-back calls
    (the steady state a serving loop reaches: a host sync per call would add its own ~10 us to a graph replay of a few
    microseconds), ``repeats`` times after a warm-up; ``inner`` is chosen so that one timed run lasts about
    ``target_s`` (1 to ``max_inner`` calls)."""
    import torch

    def run(count: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(count):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / count

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    inner = int(min(max_inner, max(1, target_s / max(run(1), 1e-7))))
    times = [run(inner) for _ in range(repeats)]
    return {"median_s": statistics.median(times), "min_s": min(times), "repeats": repeats, "inner": inner}


def flushed_timer(flush, warmup: int, reps: int) -> Callable[[Callable[[], object]], float]:
    """``measure(fn)``: median seconds of ``fn()`` on the current CUDA stream over ``reps`` calls, each timed alone by
    CUDA events after ``flush`` (a large tensor, zeroed) pushed the L2 cache out, after ``warmup`` calls."""
    import torch

    def measure(fn) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    return measure


def capture_graph(fn: Callable[[], object], warmups: int = 3):
    """``fn`` captured in a CUDA graph after ``warmups`` calls on a side stream (kernels compiled, caches filled,
    allocations made outside the capture); returns (graph, what the captured call returned)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def measure_interleaved(fns: dict[str, Callable[[], object]], rounds: int = 5, min_seconds: float = 0.3,
                        sync: Callable[[], None] | None = None) -> dict[str, dict[str, float]]:
    """Times several implementations of the same work in alternating rounds, so that a load spike on a shared
    machine hits all of them rather than one.

    Each round measures every function for ``min_seconds / rounds`` (at least one call; the first round warms
    each up); per function: ``median_s`` (median of the
    round medians) and ``ratio_vs_first`` (median over rounds of first-function time / this time: a ratio taken
    within each round, robust to drifts between rounds).
    """
    if not fns:
        return {}
    per_round: dict[str, list[float]] = {name: [] for name in fns}
    for index in range(max(rounds, 1)):
        for name, fn in fns.items():
            timing = measure(fn, min_seconds=min_seconds / max(rounds, 1), min_repeats=1, sync=sync, warmup=index == 0)
            per_round[name].append(timing["median_s"])
    first = next(iter(fns))
    return {name: {"median_s": statistics.median(times), "rounds": len(times),
                   "ratio_vs_first": statistics.median(a / b for a, b in zip(per_round[first], times))}
            for name, times in per_round.items()}


def machine(device: str) -> str:
    """CPU model and core count, or the GPU name."""
    import os
    import platform

    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    name = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"
