"""scripts/bench_ragged_decode.py (ragged decode attention and one layer's step, dense vs ragged, in CUDA graphs) on
the CPU.

Its only real run is on a GPU machine; here its parts that need no GPU run on CPU tensors: every section at tiny
shapes (SGLang's kernel and ours in Triton's interpreter where SGLang's file is found), the report's targets and
printing, the arguments, and the refusal without a GPU. The step model it times (``kvzap_export.bench.ragged_step``)
has its own tests (tests/bench/test_ragged_step.py). CUDA graphs, timings and bf16 are not exercised here.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvzap_export.bench import ragged_report, ragged_step

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_ragged_decode.py"
INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="runs SGLang's kernel on CPU tensors: needs Triton's interpreter (no GPU)")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_ragged_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible: the script would run")
def test_without_a_gpu_it_refuses_in_one_line():
    done = subprocess.run([sys.executable, str(SCRIPT), "--json", os.devnull], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "needs a CUDA GPU" in done.stderr


class ReplayedByCalling:
    """Stands in for a CUDA graph on the CPU: ``replay`` calls the function again (plumbing only: an eager-vs-replay
    comparison through it compares eager with eager)."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        result = self.fn()
        if isinstance(self.out, torch.Tensor):  # a part of the step returns nothing, or a tuple (the layer's front)
            self.out.copy_(result)


@INTERPRETED
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_every_section_runs_on_cpu_tensors(bench, monkeypatch, capsys, sglang_kernel_path):
    """The whole script, sections and report, at tiny shapes in float32 on the CPU: SGLang's kernel and our Triton
    kernel in the interpreter, a wall clock for CUDA events, ``ReplayedByCalling`` for graphs. Checks the plumbing
    (rows, kernels named, exactness verdicts, the report serialisable); timings mean nothing here."""
    import json
    import time

    from kvzap_export.kernels import sglang_kernels

    source = sglang_kernel_path  # the fixture skips, saying so, without SGLang's kernel file
    # The step model's shapes, dtype and device, read by the model (``Layer()``'s defaults) and by the script alike
    for name, value in dict(DEVICE="cpu", DTYPE=torch.float32, Q_HEADS=8, KV_HEADS=2, HEAD_DIM=16, HIDDEN=64, FFN=96,
                            SURROGATE_HIDDEN=32).items():
        monkeypatch.setattr(ragged_step, name, value)
    # the script's own: its grids, cases, targets, split setting and L2 flush size
    for name, value in dict(FLUSH_BYTES=1024, ATTENTION_GRID=[(2, 512, 0.4), (2, 512, 0.7)],
                            OLD_KERNEL_ROWS={(2, 512, 0.7)}, SWEEP_ROWS={(2, 512, 0.7): [("max", 4)]}, SPLITS=2, SMALL_BATCH_SPLITS=4,
                            LAYER_GRID=[(2, 512, 0.7)], PARTS_GRID=[(2, 512, 0.7)], EXACT_CASE=(2, 512, 0.4),
                            REPLAY_CASE=(2, 512, 0.7, 4)).items():
        monkeypatch.setattr(bench, name, value)
    monkeypatch.setattr(ragged_report, "TARGETS", [("attention", 2, 512, 0.7, 0.5, "kernel_only_ratio"),
                                                   ("layer", 2, 512, 0.7, 0.65, "ratio")])
    assert bench.model is ragged_step  # the script reads the values set above
    monkeypatch.setattr(bench, "device_name", lambda: "cpu (test)")
    monkeypatch.setattr(bench, "free_memory", lambda: 1 << 40)
    monkeypatch.setattr(bench, "allocation_count", lambda: 0)
    bench.release()  # the real one returns (it once called itself: a RecursionError at the first attention row)
    monkeypatch.setattr(bench, "release", lambda: None)

    def wall_clock(flush, warmup, reps):
        def measure(fn):
            start = time.perf_counter()
            fn()
            return max(time.perf_counter() - start, 1e-9)
        return measure

    monkeypatch.setattr(bench, "timer", wall_clock)
    monkeypatch.setattr(bench, "graphed", lambda fn: (ReplayedByCalling(fn, out := fn()), out))
    args = bench.parse_args(["--reps", "1", "--warmup", "0"])
    report, code = bench.run(args, sglang_kernels.load(source or None))
    assert report["errors"] == [] and code == 0, report["errors"]
    assert [r["passed"] for r in report["exactness"]] == [True] * 5
    kernels = [(r["kernel"], r["pruned"]) for r in report["attention"]]
    dense = [(name, 0.0) for name in ragged_step.dense_variants()] + [("sglang-dense", 0.0)]  # SDPA's layouts here
    kept = [r["kernel"] for r in report["attention"] if "kept" in r["kernel"]]
    assert len(kept) == 2 and kept[0] == kept[1] in ("sdpa-dense over the kept length", "sdpa-gqa over the kept length")
    assert kernels == dense + [(kept[0], 0.4), ("sglang-step", 0.4), ("sglang-flattened", 0.4), (kept[0], 0.7),
                               ("sglang-step", 0.7), ("sglang-flattened", 0.7), ("sglang-flattened", 0.7),
                               ("triton-ragged (ours)", 0.7)]
    assert [r["kernel"] for r in report["attention"] if r.get("default")] == ["sglang-step"] * 2
    assert sum(bool(r.get("baseline")) for r in report["attention"]) == 1  # one dense baseline per (batch, T)
    layer = report["layer"][0]
    variants = {name: layer[f"{name}_graph_us"] for name, _ in dense}
    assert layer["dense_baseline"] == min(variants, key=variants.get)
    assert layer["dense_graph_us"] == min(variants.values())
    rows = report["attention"] + report["layer"] + report["parts"] + report["exactness"] + [report["replay"]]
    assert all(r["device"] == "cpu (test)" and r["kernel"] for r in rows)
    parts = {(r["mode"], r["part"]): r for r in report["parts"]}
    common = {"front", "kv_write", "back"}
    assert set(parts) == ({("dense", p) for p in common | {f"attention ({name})" for name, _ in dense}}
                          | {("ragged", p) for p in common | {"layout", "attention", "scoring", "decisions"}})
    assert all(r["graph_us"] > 0 and (r["batch"], r["seq"], r["pruned"]) == (2, 512, 0.7) for r in parts.values())
    assert {r["kernel"] for r in parts.values() if r["mode"] == "ragged"} == {"sglang-step"}
    assert [parts[("dense", f"attention ({name})")]["kernel"] for name, _ in dense] == [name for name, _ in dense]
    assert report["replay"]["passed"] and report["replay"]["bookkeeping_equal"]
    assert report["replay"]["evicted_fraction"] > 0  # heads were pruned during the replayed steps
    assert [t["name"].split(":")[0] for t in report["targets"]] == [
        "attention batch 2 T 512 pruned 0.7 (SGLang's kernel alone)", "layer batch 2 T 512 pruned 0.7 (graphed step)"]
    assert all(isinstance(t["value"], float) for t in report["targets"])
    json.dumps(report)
    bench.print_report(report)
    assert "replay" in capsys.readouterr().out


def test_targets_and_report(bench, capsys):
    fake = object.__new__(bench.Bench)
    fake.device_name = "CPU stand-in"
    fake.report = {"device": "CPU stand-in", "kernel_source": {"origin": "wheel", "location": "x.whl", "stood_in": {}},
                   "exactness": [{"kernel": "k", "max_abs_err": 1e-4, "max_abs_ref": 1.0, "passed": True}],
                   "attention": [{"kernel": "sglang-flattened", "policy": "proportional", "max_kv_splits": 32,
                                  "batch": 16, "seq": 32768, "pruned": 0.7, "time_us": 300.0, "ratio": 0.53,
                                  "kernel_only_us": 250.0, "kernel_only_ratio": 0.43, "gbps": 2000.0, "default": True},
                                 {"kernel": "sglang-flattened", "policy": "max", "max_kv_splits": 32, "batch": 16,
                                  "seq": 32768, "pruned": 0.4, "time_us": 600.0, "ratio": 0.7, "gbps": 2000.0,
                                  "default": False}],
                   "layer": [{"batch": 16, "seq": 32768, "pruned": 0.4, "dense_graph_us": 900.0,
                              "ragged_graph_us": 900.0, "ratio": 1.0, "dense_eager_us": 1.0, "ragged_eager_us": 1.0}],
                   "replay": None, "targets": [], "errors": [{"section": "layer", "error": "RuntimeError: x"}]}
    fake.targets()
    verdicts = {t["name"].split(":")[0]: t["passed"] for t in fake.report["targets"]}
    kernel, layout = "(SGLang's kernel alone)", "(with its layout)"
    assert verdicts == {f"attention batch 16 T 32768 pruned 0.7 {kernel}": True,  # 0.43 <= 0.5
                        f"attention batch 16 T 32768 pruned 0.7 {layout}": False,  # 0.53 > 0.5
                        f"attention batch 16 T 32768 pruned 0.4 {kernel}": None,  # no default row there
                        f"attention batch 16 T 32768 pruned 0.4 {layout}": None,
                        f"attention batch 1 T 32768 pruned 0.7 {kernel}": None,
                        f"attention batch 1 T 32768 pruned 0.7 {layout}": None,
                        "layer batch 16 T 32768 pruned 0.7 (graphed step)": None,
                        "layer batch 16 T 32768 pruned 0.4 (graphed step)": False}
    bench.print_report(fake.report)
    printed = capsys.readouterr().out
    assert "ERROR in layer" in printed and "x0.53 dense" in printed and "kernel alone 250.0 us x0.43" in printed


def test_arguments(bench):
    args = bench.parse_args(["--sglang-kernels", "w.whl", "--reps", "5", "--only", "attention"])
    assert (args.sglang_kernels, args.reps, args.only, args.budget_s) == ("w.whl", 5, "attention", 110.0)
