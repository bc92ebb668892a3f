"""``scripts/gpu_check.sh`` end to end where there is no GPU (one line, exit 2), and its summary
(``scripts/gpu_check_summary.py``) on the files its steps leave: verdict, exit status, targets, the device on every
figure. What it reads is made here by hand: plumbing, not a GPU measurement."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
sys.path.insert(0, str(REPO / "scripts"))

import gpu_check_summary  # noqa: E402


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU: the script would run its checks")
def test_without_a_gpu_the_script_refuses_in_one_line(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "no NVIDIA GPU" in done.stderr
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_usage_without_outdir():
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "OUTDIR" in done.stdout


def _write_run(out: Path, *, sanitizer_errors=0, validate_verdict="incomplete", pytest_failures=0, rc_bench="0",
               ragged_exact=True, not_run=(), skip_reason=None, ragged_step="bench_ragged_decode\tskipped\t0\t1") -> None:
    not_run = list(not_run)
    out.mkdir()
    (out / "steps.tsv").write_text("build_cuda_library\t0\t8\nvalidate_1\t3\t40\npytest_gpu\t0\t60\n"
                                   f"sanitizer_memcheck\t0\t70\nbench_kernels\t0\t30\nbench_cuda\t{rc_bench}\t80\n"
                                   f"{ragged_step}\n")
    (out / "bundles.tsv").write_text("validate_1\t/nowhere/b32\n")
    (out / "validate_1.json").write_text(json.dumps({
        "verdict": validate_verdict, "failed": [] if validate_verdict != "failed" else ["operator:surrogate_layer_002"],
        "not_run": [{"check": "model:compacted_vs_kvpress", "level": "model"}] + not_run, "device": {"kind": "cuda"},
        "checks": [{"name": "operator:surrogate_layer_000", "status": "passed", "detail": {"bound_used": {"torch": 0.05, "onnxrt": 0.06}}}]}))
    cases = "".join(f'<testcase classname="t" name="c{i}"/>' for i in range(3))
    if skip_reason:
        cases += f'<testcase classname="t" name="s"><skipped message="{skip_reason}"/></testcase>'
    failure = '<testcase classname="t" name="bad"><failure message="x"/></testcase>' if pytest_failures else ""
    (out / "pytest-gpu.xml").write_text(f'<testsuites><testsuite tests="{3 + pytest_failures}" failures="{pytest_failures}" '
                                        f'errors="0" skipped="0">{cases}{failure}</testsuite></testsuites>')
    (out / "sanitizer_memcheck.log").write_text("check: the Triton kernels exactly equal the reference on GPU X\n"
                                                f"========= ERROR SUMMARY: {sanitizer_errors} errors\n")
    (out / "bench-kernels.json").write_text(json.dumps({"meta": {"device": "NVIDIA H100 80GB HBM3"}, "rows": [
        {"benchmark": "compaction", "impl": "cuda", "seq": 131072, "speedup": 6.1},
        {"benchmark": "compaction", "impl": "triton", "seq": 131072, "speedup": 7.0}]}))
    (out / "bench-cuda.json").write_text(json.dumps({"machine": "NVIDIA H100 80GB HBM3", "results": {"overhead": [
        {"benchmark": "overhead", "phase": "decode", "variant": "mlp", "kv_len": 32768, "overhead_graphed_time_pct": 7.5},
        {"benchmark": "overhead", "phase": "prefill", "variant": "mlp", "q_len": 32768, "compaction": "Triton fused launcher",
         "overhead_time_pct": 1.6}]}}))
    (out / "ragged-decode.json").write_text(json.dumps({
        "device": "NVIDIA H100 80GB HBM3", "errors": [], "replay": None,
        "exactness": [{"device": "NVIDIA H100 80GB HBM3", "kernel": "sglang-flattened", "max_abs_err": 1e-3, "passed": ragged_exact}],
        "attention": [{"device": "NVIDIA H100 80GB HBM3", "batch": 16, "seq": 32768, "pruned": 0.7, "ratio": 0.4}],
        "layer": [], "targets": [{"device": "NVIDIA H100 80GB HBM3", "name": "attention batch 16 T 32768 pruned 0.7: "
                                  "ragged/dense <= 0.5", "value": 0.4, "limit": 0.5, "passed": True}]}))


def test_summary_of_a_run_whose_checks_passed_but_a_step_did_not_run(tmp_path, capsys):
    _write_run(tmp_path / "out")
    assert gpu_check_summary.main([str(tmp_path / "out")]) == 3  # the ragged step ran out of budget
    summary = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert summary["verdict"] == "incomplete" and summary["failed"] == [] and summary["not_run"] == ["step:bench_ragged_decode"]
    assert all(f["device"] == "NVIDIA H100 80GB HBM3" for f in summary["figures"]) and summary["figures"]
    targets = {t["target"]: t["met"] for t in summary["targets"]}
    assert targets["cuda fused compaction vs torch reference at 131072 tokens"] is True
    assert targets["decode at 32768: MLP scoring + decision / attention block (CUDA graphs)"] is False  # 7.5% > 5%
    assert targets["prefill 32768: MLP scoring + Triton fused launcher / attention block"] is True
    assert targets["attention batch 16 T 32768 pruned 0.7: ragged/dense <= 0.5"] is True
    validate = next(c for c in summary["checks"] if c["check"].startswith("validate"))
    assert validate["status"] == "passed" and validate["surrogate_bound_used_max"] == 0.06
    md = (tmp_path / "out" / "gpu-check.md").read_text()
    assert md.startswith("# GPU check: INCOMPLETE") and "MISSED" in md and "NVIDIA H100 80GB HBM3" in md


@pytest.mark.parametrize("partial", [
    {"not_run": [{"check": "operator:threshold_compaction_plugin", "level": "operator"}]},
    {"skip_reason": "needs a CUDA GPU; none is visible to torch on this machine"},
    {"ragged_step": "bench_ragged_decode\t124\t40\t1"},  # stopped by the overall budget, not its own limit
    {"ragged_step": "bench_ragged_decode\tmissing\t0\t0"},
])
def test_what_did_not_run_is_never_counted_as_passed(tmp_path, partial):
    _write_run(tmp_path / "out", **partial)
    assert gpu_check_summary.main([str(tmp_path / "out")]) == 3
    summary = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert summary["verdict"] == "incomplete" and summary["failed"] == [] and summary["not_run"]


def test_a_step_past_its_own_limit_failed(tmp_path):
    _write_run(tmp_path / "out", ragged_step="bench_ragged_decode\t124\t150\t0")
    assert gpu_check_summary.main([str(tmp_path / "out")]) == 1


@pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU")
def test_a_non_empty_outdir_or_a_non_bundle_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.json").write_text("{}")
    done = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "not empty" in done.stderr
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "new"), str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "not a bundle" in done.stderr and not (tmp_path / "new").exists()


@pytest.mark.parametrize("broken", [{"sanitizer_errors": 2}, {"validate_verdict": "failed"}, {"pytest_failures": 1},
                                    {"rc_bench": "124"}, {"ragged_exact": False}])
def test_any_failed_check_fails_the_run(tmp_path, broken):
    _write_run(tmp_path / "out", **broken)
    assert gpu_check_summary.main([str(tmp_path / "out")]) == 1
    summary = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert summary["verdict"] == "failed" and summary["failed"]
