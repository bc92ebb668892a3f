"""scripts/bench_kernels.py (the GPU benchmark and exactness check of the Triton and CUDA kernels) on the CPU.

Its only real run is on a GPU machine, whose time is scarce, so its plumbing is exercised here: rows, table,
targets, the check's verdicts and what its report names. Two things differ from the GPU run:

- the Triton kernels run in Triton's CPU interpreter (tests/conftest.py), so the script's Triton comparisons are
  real ones: the kernels' own code against the PyTorch reference;
- the CUDA library cannot run without a GPU: ``ReferenceStandIn`` takes its place, with the methods the script
  calls computed *by the reference itself*. Its rows compare the reference with itself, so they check only the
  script's wiring (that the CUDA rows are measured, compared and reported, and a wrong keep is caught), never the
  CUDA kernels; the report names the stand-in, not a CUDA library. The CUDA kernels are compared with the
  reference on a GPU (tests/plugins/test_cuda_kernels.py, ``bench_kernels.py --check``).

CUDA events are replaced by a wall clock; timings are not checked.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvzap_export.ops.compaction import Compaction, kv_compaction, threshold_compaction

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_kernels.py"


@pytest.fixture
def script(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "DEVICE", "cpu")
    monkeypatch.setattr(module, "ODD_SHAPES", ((2, 2, 45, 3),))  # the interpreter is slow: small shapes only

    def wall_clock_timer(torch_, flush, warmup, reps):
        def measure(fn):
            start = time.perf_counter()
            fn()
            return max(time.perf_counter() - start, 1e-9)
        return measure

    monkeypatch.setattr(module, "_timer", wall_clock_timer)
    return module


class ReferenceStandIn:
    """``CudaKernels``' methods as the script calls them, computed by the reference (``flip``: one wrong keep).

    Plumbing only: comparing it with the reference compares the reference with itself.
    """

    path = "<stand-in computed by the PyTorch reference>"

    def __init__(self, flip: bool = False):
        self.flip = flip

    def launch_threshold_compaction(self, scores, lengths, threshold, window, sink=0, keep_dtype=torch.bool, out=None):
        got = threshold_compaction(scores, lengths, float(threshold), int(window), int(sink))
        keep = got.keep.clone()
        if self.flip:
            keep[0, 0, 0] = ~keep[0, 0, 0]
        return Compaction(keep.to(keep_dtype), got.counts, got.indices)

    def threshold_compaction(self, scores, lengths, threshold, window, sink=0, keep_dtype=torch.bool):
        return self.launch_threshold_compaction(scores, lengths, threshold, window, sink, keep_dtype)

    def threshold_compaction_grid(self, batch, heads, seq):
        return batch * heads, seq

    def launch_kv_compaction(self, keys, values, indices, out=None):
        return kv_compaction(keys, values, indices)

    kv_compaction = launch_kv_compaction


def args_for(script, *extra):
    return script.parse_args(["--seq", "150", "300", "--heads", "2", "--head-dim", "8", "--dtype", "float16",
                              "--window", "16", "--warmup", "0", "--reps", "1", *extra])


def test_bench_rows_table_and_targets_cover_both_kernel_slots(script):
    args = args_for(script, "--rows", "4", "8")
    rows = script.bench(args, ReferenceStandIn())
    keys = {(r["benchmark"], r["impl"], r["seq"]) for r in rows}
    assert keys == {(b, impl, seq) for b in ("compaction", "kv_move") for impl in ("triton", "cuda") for seq in (150, 300)}
    assert sum(r["benchmark"] == "kv_move" and r["impl"] == "triton" for r in rows) == 4  # 2 row sizes x 2 lengths
    for r in rows:
        assert r["kernel_us"] > 0 and r["torch_reference_us"] > 0
        if r["benchmark"] == "kv_move":
            assert 0.3 < r["kept_fraction"] < 0.8 and r["pct_of_copy_bandwidth"] > 0
    table = script._table(rows)
    assert "| 300 | cuda | 2 blocks of 300 positions |" in table and "| 150 | triton | 4 rows/program |" in table
    targets = script._targets(rows)
    assert len(targets) == 4 and all("T=300" in line for line in targets)
    assert [line.split()[1] for line in targets] == ["triton", "triton", "cuda", "cuda"]
    json.dumps(rows)  # the --json payload


def test_check_wiring_passes_the_stand_in_reports_a_wrong_keep_and_names_what_it_compared(script, capsys):
    """The Triton rows are a real comparison (interpreted kernels vs reference); the "cuda" rows only wiring."""
    args = args_for(script)
    args.seq = [40]
    assert script.check(args, ReferenceStandIn()) is True
    assert ("check: the Triton kernels and the CUDA kernels of <stand-in computed by the PyTorch reference> exactly "
            "equal the reference on cpu") in capsys.readouterr().out
    assert script.check(args, ReferenceStandIn(flip=True)) is False
    out = capsys.readouterr().out
    assert "MISMATCH cuda compaction" in out and "MISMATCH triton" not in out


def test_without_a_gpu_the_script_says_so_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    done = subprocess.run([sys.executable, str(SCRIPT), "--seq", "4096"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == "bench_kernels: needs a CUDA GPU; none is visible to torch on this machine"
    helped = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=300)
    assert helped.returncode == 0 and "--cuda-lib" in helped.stdout and "CUDA C" in helped.stdout
