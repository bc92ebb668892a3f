"""Runs the benchmark suite and returns one JSON document with a stable schema."""

from __future__ import annotations

import datetime
import sys
from collections.abc import Callable

from kvzap_export.provenance import checkout_commit, command_line

SCHEMA = "kvzap-export-bench/1"


def _suites(device: str, compile_scoring: bool = False) -> dict[str, Callable[[], list[dict]]]:
    from kvzap_export.bench.compaction import bench_compaction
    from kvzap_export.bench.e2e import bench_e2e
    from kvzap_export.bench.overhead import bench_overhead
    from kvzap_export.bench.scoring import bench_scoring

    prefill = (4096, 32768) if device == "cuda" else (4096,)
    return {
        "scoring": lambda: bench_scoring(device, compile_torch=compile_scoring),
        "compaction": lambda: bench_compaction(device),
        "overhead": lambda: bench_overhead(device, prefill=prefill),
        "e2e": lambda: bench_e2e(),
    }


def _skipped_suite(name: str, exc: Exception) -> list[dict]:
    """A suite whose optional part is missing here (the model, kvpress, ...): one row saying what and how to get it."""
    return [{"benchmark": name, "skipped": str(exc).splitlines()[0]}]


def run_bench(device: str = "cpu", only: tuple[str, ...] | None = None, progress=None, compile_scoring: bool = False) -> dict:
    import torch

    from kvzap_export.bench.timing import machine
    from kvzap_export.errors import MissingDependencyError

    torch.manual_seed(0)
    suites = _suites(device, compile_scoring)
    chosen = [name for name in suites if only is None or name in only]
    advance = progress("benchmarks", len(chosen)) if progress else None
    results, errors = {}, []
    for name in chosen:
        try:
            results[name] = suites[name]()
        except (MissingDependencyError, ModuleNotFoundError) as exc:
            results[name] = _skipped_suite(name, exc)
        except Exception as exc:  # noqa: BLE001 - one suite's failure must not lose the others' figures
            results[name] = [{"benchmark": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}]
            errors.append(name)
        if advance:
            advance()
    return {
        "schema": SCHEMA,
        "machine": machine(device),
        "device": device,
        "date": datetime.date.today().isoformat(),
        "command": command_line() if sys.argv and sys.argv[0].endswith("kvzap-export") else "kvzap-export bench",
        "commit": checkout_commit(),
        "torch": torch.__version__,
        "results": results,
        "errors": errors,  # suites that raised: the command exits 1 after writing what the others measured
    }
