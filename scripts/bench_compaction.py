#!/usr/bin/env python
"""Threshold compaction at long sequences: the std-ops ONNX graph in ONNX Runtime (CPU) vs the torch reference.

    python scripts/bench_compaction.py                      # Llama-3.1-8B shapes: batch 1, 8 KV heads
    python scripts/bench_compaction.py --seq 4096 32768 131072 --heads 8 --threshold 0.0

Each (backend, length) runs in its own child process, so its memory is measured alone: once the
inputs and the session exist, the child resets its peak-RSS mark (``/proc/self/clear_refs``), runs
the op once and reports ``VmHWM`` minus the ``VmRSS`` just before that call as the op's peak extra
memory (later calls reuse what the allocators kept); then it times the op (median of repeats). The ORT child then checks its outputs against the
reference (exact equality of keep/counts/indices). Both backends run in one invocation, so the ratio
compares like with like on a shared machine. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BACKENDS = ("torch_reference", "ort_std_ops")


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _inputs(batch: int, heads: int, seq: int):
    import torch

    gen = torch.Generator().manual_seed(seq)
    scores = torch.randn(batch, heads, seq, generator=gen)
    scores[..., ::97] = float("nan")  # kept (strict <)
    lengths = torch.full((batch,), seq, dtype=torch.int32)
    return scores, lengths


def worker(backend: str, batch: int, heads: int, seq: int, threshold: float, window: int, min_seconds: float) -> dict:
    import numpy as np
    import torch

    from kvzap_export.ops import threshold_compaction

    scores, lengths = _inputs(batch, heads, seq)
    if backend == "ort_std_ops":
        from kvzap_export.export.compaction_onnx import PATHS, export_compaction_artifacts
        from kvzap_export.runners.onnxrt import ort_session

        tmp = tempfile.TemporaryDirectory()
        export_compaction_artifacts(Path(tmp.name), heads, 128, "float32", 20)
        session = ort_session(Path(tmp.name) / PATHS["threshold_compaction"])
        feed = {"scores": scores.numpy(), "lengths": lengths.numpy(), "threshold": np.array(threshold, np.float32),
                "window": np.array(window, np.int32)}
        run = lambda: session.run(["keep", "counts", "indices"], feed)  # noqa: E731
    else:
        run = lambda: threshold_compaction(scores, lengths, threshold, window)  # noqa: E731
    # Peak memory of the first call over the resident set just before it (inputs and session included
    # in the baseline): later calls reuse what the allocators retained, so the first one shows the need.
    reset = _reset_peak()
    before = _status_kib("VmRSS")
    out = run()
    peak = _status_kib("VmHWM") if reset else None
    del out
    times = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_seconds and len(times) < 50):
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
        del out
    row = {"backend": backend, "seq": seq, "median_s": statistics.median(times), "min_s": min(times), "repeats": len(times),
           "peak_extra_mib": None if peak is None else (peak - before) / 1024, "threads": torch.get_num_threads()}
    if backend == "ort_std_ops":
        ref = threshold_compaction(scores, lengths, threshold, window)
        keep, counts, indices = run()
        row["exact"] = bool(np.array_equal(keep, ref.keep.numpy()) and np.array_equal(counts, ref.counts.numpy())
                            and np.array_equal(indices, ref.indices.numpy()))
        row["kept_fraction"] = float(ref.counts.sum()) / (batch * heads * seq)
    return row


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8, help="KV heads (Llama-3.1-8B: 8)")
    parser.add_argument("--threshold", type=float, default=0.0, help="scores are N(0, 1): 0.0 prunes about half")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--min-seconds", type=float, default=2.0, help="time budget per (backend, length)")
    parser.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        print(json.dumps(worker(args.worker, args.batch, args.heads, args.seq[0], args.threshold, args.window, args.min_seconds)))
        return

    rows = {}
    for seq in args.seq:
        for backend in BACKENDS:
            cmd = [sys.executable, __file__, "--worker", backend, "--seq", str(seq), "--batch", str(args.batch), "--heads",
                   str(args.heads), "--threshold", str(args.threshold), "--window", str(args.window), "--min-seconds",
                   str(args.min_seconds)]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            rows[(seq, backend)] = json.loads(done.stdout.strip().splitlines()[-1])

    def mib(value):
        return "n/a" if value is None else f"{value:.1f}"

    print(f"Machine: {cpu_name()}, {os.cpu_count()} cores; date {datetime.date.today()}; "
          f"batch {args.batch}, {args.heads} KV heads, float32 scores, threshold {args.threshold}, window {args.window}")
    print(f"Command: python scripts/bench_compaction.py {' '.join(sys.argv[1:])}".rstrip())
    print()
    print("| seq | torch reference (ms) | ORT std-ops (ms) | ORT / torch time | torch peak extra (MiB) | ORT peak extra (MiB) "
          "| ORT exact vs reference | kept fraction |")
    print("|---|---|---|---|---|---|---|---|")
    for seq in args.seq:
        ref, ort = rows[(seq, "torch_reference")], rows[(seq, "ort_std_ops")]
        print(f"| {seq} | {ref['median_s'] * 1e3:.2f} | {ort['median_s'] * 1e3:.2f} | {ort['median_s'] / ref['median_s']:.2f} | "
              f"{mib(ref['peak_extra_mib'])} | {mib(ort['peak_extra_mib'])} | {'yes' if ort['exact'] else 'NO'} | "
              f"{ort['kept_fraction']:.3f} |")


if __name__ == "__main__":
    main()
