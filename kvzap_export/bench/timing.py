"""Wall-clock timing that is honest on shared, noisy machines: warm up, repeat, report the median."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def measure(fn: Callable[[], object], min_seconds: float = 0.3, min_repeats: int = 3, max_repeats: int = 200,
            sync: Callable[[], None] | None = None) -> dict[str, float]:
    """Median and min seconds per call of ``fn`` after one warm-up call."""
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
