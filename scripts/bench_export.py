#!/usr/bin/env python
"""Wall time and peak RSS of a full bundle export at a preset's real shapes (synthetic weights).

    python scripts/bench_export.py --model llama-3.1-8b --variant mlp

The export runs in a child process, so its peak RSS is measured alone (ru_maxrss of the child).
Prints one markdown table row per run.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


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
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--variant", default="mlp", choices=["linear", "mlp"])
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    from kvzap_export.presets import load_preset
    from tests.helpers import synthetic_checkpoint

    preset = load_preset(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        weights = synthetic_checkpoint(preset, args.variant, Path(tmp) / "weights")
        params = sum(p.numel() for p in __import__("kvzap_export.surrogate", fromlist=["load_surrogate"]).load_surrogate(weights).parameters())
        cmd = [sys.executable, "-m", "kvzap_export.cli.main", "--model", args.model, "--variant", args.variant,
               "--weights", str(weights), "--dtype", args.dtype, "--out", str(Path(tmp) / "engine"), "--quiet"]
        start = time.perf_counter()
        subprocess.run(cmd, check=True)
        wall = time.perf_counter() - start
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        size_mb = sum(f.stat().st_size for f in (Path(tmp) / "engine").rglob("*") if f.is_file()) / 2**20
    print("| model | variant | dtype | layers | parameters | wall time (s) | peak RSS (MiB) | bundle (MiB) | machine | date |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.model} | {args.variant} | {args.dtype} | {preset.num_layers} | {params / 1e6:.1f}M | {wall:.1f} | {peak_mb:.0f} | "
          f"{size_mb:.0f} | {cpu_name()}, {__import__('os').cpu_count()} cores | {datetime.date.today()} |")


if __name__ == "__main__":
    main()
