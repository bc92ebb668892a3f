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

from tests.gpu_check_engine_files import write_engine_run  # noqa: E402


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


GPU = "NVIDIA H100 80GB HBM3"
STEPS = ("build_cuda_library", "bench_ragged_decode", "validate_1", "pytest_kernels", "pytest_gpu", "sanitizer_memcheck",
         "bench_kernels", "bench_cuda")


def _write_run(out: Path, *, steps=None, sanitizer_errors=0, validate_verdict="passed", not_run=(), pytest_failures=0,
               skip_reason=None, ragged_exact=True, ragged=None, bench=None, kernel_impls=("cuda", "triton"),
               sanitizer_log=None, bundles=True, engine=None) -> None:
    """The files of a run where every step ran and every check passed; the keywords break one part of it.
    ``steps``: NAME -> "rc\tseconds\tcut" (None: the row is absent); ``ragged`` / ``bench``: keys replaced in the
    ragged report / bench's results; ``engine``: keywords of the SGLang steps' files (gpu_check_engine_files.py)."""
    out.mkdir()
    validate_rc = {"passed": "0", "failed": "1", "incomplete": "3"}[validate_verdict]
    rows = {name: "0\t30\t0" for name in STEPS} | {"validate_1": f"{validate_rc}\t40\t0"}
    rows |= write_engine_run(out, **{"device": GPU, **(engine or {})}) | (steps or {})
    (out / "steps.tsv").write_text("".join(f"{name}\t{row}\n" for name, row in rows.items() if row is not None))
    if bundles:
        (out / "bundles.tsv").write_text("validate_1\t/nowhere/b32\n")
    (out / "validate_1.json").write_text(json.dumps({
        "verdict": validate_verdict, "failed": [] if validate_verdict != "failed" else ["operator:surrogate_layer_002"],
        "not_run": list(not_run), "device": {"kind": "cuda"},
        "checks": [{"name": "operator:surrogate_layer_000", "status": "passed", "detail": {"bound_used": {"torch": 0.05, "onnxrt": 0.06}}}]}))
    for name in ("pytest-gpu.xml", "pytest-kernels.xml"):
        cases = "".join(f'<testcase classname="t" name="c{i}"/>' for i in range(3))
        if skip_reason and name == "pytest-gpu.xml":
            cases += f'<testcase classname="t" name="s"><skipped message="{skip_reason}"/></testcase>'
        if pytest_failures and name == "pytest-gpu.xml":
            cases += '<testcase classname="t" name="bad"><failure message="x"/></testcase>'
        skips = int(bool(skip_reason and name == "pytest-gpu.xml"))
        (out / name).write_text(f'<testsuites><testsuite tests="{3 + skips + pytest_failures}" failures="{pytest_failures}" '
                                f'errors="0" skipped="{skips}">{cases}</testsuite></testsuites>')
    (out / "sanitizer_memcheck.log").write_text(sanitizer_log if sanitizer_log is not None else
                                                "check: the Triton kernels and the CUDA kernels of /x/libkvzap_kernels.so "
                                                f"exactly equal the reference on GPU X\n========= ERROR SUMMARY: {sanitizer_errors} errors\n")
    (out / "bench-kernels.json").write_text(json.dumps({"meta": {"device": GPU}, "rows": [
        {"benchmark": "compaction", "impl": impl, "seq": 131072, "speedup": speedup}
        for impl, speedup in (("cuda", 6.1), ("triton", 7.0)) if impl in kernel_impls]}))
    results = {"scoring": [{"benchmark": "scoring", "backend": "torch_graphed", "median_s": 1e-5}],
               "compaction": [{"benchmark": "compaction", "seq": 4096, "backend": "cuda_kernel", "median_s": 1e-5}],
               "overhead": [
                   {"benchmark": "overhead", "phase": "decode", "variant": "mlp", "kv_len": 32768, "overhead_graphed_time_pct": 7.5},
                   {"benchmark": "overhead", "phase": "prefill", "variant": "mlp", "q_len": 32768,
                    "compaction": "Triton fused launcher", "overhead_time_pct": 1.6}],
               "e2e": [{"benchmark": "e2e", "tokens_per_s": 50.0}]} | (bench or {})
    (out / "bench-cuda.json").write_text(json.dumps({"machine": GPU, "results": results}))
    (out / "ragged-decode.json").write_text(json.dumps({
        "device": GPU, "errors": [], "skipped": [],
        "exactness": [{"device": GPU, "kernel": "sglang-flattened", "max_abs_err": 1e-3, "passed": ragged_exact}],
        "attention": [{"device": GPU, "batch": 16, "seq": 32768, "pruned": 0.7, "ratio": 0.4}],
        "layer": [{"device": GPU, "batch": 16, "seq": 32768, "pruned": 0.7, "ratio": 0.6}],
        "replay": {"device": GPU, "kernel": "sglang-step", "bookkeeping_equal": True, "passed": True},
        "parts": [{"device": GPU, "part": "attention", "time_us": 100.0}],
        "targets": [{"device": GPU, "name": "attention batch 16 T 32768 pruned 0.7: ragged/dense <= 0.5", "value": 0.4,
                     "limit": 0.5, "passed": True}]} | (ragged or {})))


def _summary(out: Path) -> tuple[int, dict, str]:
    code = gpu_check_summary.main([str(out)])
    return code, json.loads((out / "gpu-check.json").read_text()), (out / "gpu-check.md").read_text()


def test_a_run_where_everything_ran_and_passed(tmp_path):
    _write_run(tmp_path / "out")
    code, summary, md = _summary(tmp_path / "out")
    assert code == 0 and summary["verdict"] == "passed" and summary["failed"] == [] and summary["not_run"] == []
    assert all(c["status"] == "passed" for c in summary["checks"]) and "–" not in md.split("## Figures")[0]
    assert {c["check"] for c in summary["checks"]} >= {f"step:{name}" for name in STEPS}
    assert md.startswith("# GPU check: PASSED")


def test_summary_of_a_run_whose_checks_passed_but_a_step_did_not_run(tmp_path, capsys):
    _write_run(tmp_path / "out", steps={"bench_ragged_decode": "skipped\t0\t1"})
    code, summary, md = _summary(tmp_path / "out")
    assert code == 3  # the ragged step ran out of budget
    assert summary["verdict"] == "incomplete" and summary["failed"] == [] and summary["not_run"] == ["step:bench_ragged_decode"]
    assert all(f["device"] == GPU for f in summary["figures"]) and summary["figures"]
    targets = {t["target"]: t["met"] for t in summary["targets"]}
    assert targets["cuda fused compaction vs torch reference at 131072 tokens"] is True
    assert targets["decode at 32768: MLP scoring + decision / attention block (CUDA graphs)"] is False  # 7.5% > 5%
    assert targets["prefill 32768: MLP scoring + Triton fused launcher / attention block"] is True
    assert targets["attention batch 16 T 32768 pruned 0.7: ragged/dense <= 0.5"] is True
    validate = next(c for c in summary["checks"] if c["check"].startswith("validate"))
    assert validate["status"] == "passed" and validate["surrogate_bound_used_max"] == 0.06
    assert md.startswith("# GPU check: INCOMPLETE") and "MISSED" in md and GPU in md
    assert "- step:bench_ragged_decode: the time budget was spent" in md.split("## Checks")[0]
    assert "- – step:bench_ragged_decode" in md and "✓ step:bench_ragged_decode" not in md


VALIDATE_MODEL_NOT_RUN = {"validate_verdict": "incomplete",
                          "not_run": [{"check": "model:compacted_vs_kvpress", "level": "model", "reason": "no model here"}]}


@pytest.mark.parametrize("partial, item, why", [
    ({"validate_verdict": "incomplete", "not_run": [{"check": "operator:threshold_compaction_plugin", "level": "operator",
                                                     "reason": "onnxruntime-extensions is not installed"}]},
     "validate --device cuda /nowhere/b32: checks that did not run", "onnxruntime-extensions is not installed"),
    (VALIDATE_MODEL_NOT_RUN, "step:validate_1", "exit 3"),  # validate's "incomplete" is not a pass
    (VALIDATE_MODEL_NOT_RUN, "validate --device cuda /nowhere/b32: checks that did not run", "model:compacted_vs_kvpress"),
    ({"skip_reason": "needs a CUDA GPU; none is visible to torch on this machine"}, "pytest -m gpu", "needs a CUDA GPU"),
    ({"skip_reason": "TensorRT is not installed"}, "pytest -m gpu", "t.s: TensorRT is not installed"),  # any reason
    ({"steps": {"bench_ragged_decode": "124\t40\t1"}}, "step:bench_ragged_decode", "time budget ran out"),
    ({"steps": {"bench_ragged_decode": "missing\t0\t0"}}, "step:bench_ragged_decode", "not on this machine"),
    ({"steps": {"pytest_kernels": None}}, "step:pytest_kernels", "not in steps.tsv"),  # a step always run, not recorded
    ({"steps": {"sanitizer_memcheck": "missing\t0\t0"}, "sanitizer_log": "compute-sanitizer is not on PATH\n"},
     "step:sanitizer_memcheck", "compute-sanitizer is not on PATH"),  # its log holds the reason, not a summary
    ({"sanitizer_log": "check: the Triton kernels (CUDA library not loaded) exactly equal the reference on X\n"
                       "========= ERROR SUMMARY: 0 errors\n", "kernel_impls": ("triton",)},
     "compute-sanitizer memcheck: the CUDA kernels", "Triton kernels only"),
    ({"kernel_impls": ("triton",)}, "bench_kernels.py: the cuda kernels", "no rows"),
    ({"kernel_impls": ("triton",)}, "target: cuda fused compaction vs torch reference at 131072 tokens", "not measured"),
    ({"bench": {"e2e": [{"benchmark": "e2e", "skipped": "the e2e suite did not run: it needs the model"}]}},
     "kvzap-export bench --device cuda: rows that did not run", "e2e: the e2e suite did not run"),
    ({"bench": {"compaction": [{"benchmark": "compaction", "seq": 4096, "backend": "onnxruntime_plugin",
                                "skipped": "onnxruntime-extensions is not installed"}]}},
     "kvzap-export bench --device cuda: rows that did not run", "compaction: onnxruntime-extensions is not installed"),
    ({"ragged": {"parts": [], "skipped": ["parts batch 16 T 32768 pruned 0.7: time budget"]}}, "ragged rows skipped",
     "parts batch 16 T 32768 pruned 0.7: time budget"),
    ({"ragged": {"parts": []}}, "ragged section parts", "no rows"),
    ({"ragged": {"replay": None}}, "ragged section replay", "no rows"),
    ({"ragged": {"partial": True}}, "ragged benchmark's end", "partial"),
    ({"ragged": {"targets": [{"device": GPU, "name": "layer batch 64 T 32768 pruned 0.7 (graphed step): ragged/dense <= 0.8",
                              "value": None, "limit": 0.8, "passed": None}]}},
     "target: layer batch 64 T 32768 pruned 0.7 (graphed step): ragged/dense <= 0.8", "not measured"),
    ({"bundles": False}, "validate --device cuda", "no BUNDLE was given"),
])
def test_what_did_not_run_is_never_counted_as_passed(tmp_path, partial, item, why):
    _write_run(tmp_path / "out", **partial)
    code, summary, md = _summary(tmp_path / "out")
    assert code == 3 and summary["verdict"] == "incomplete" and summary["failed"] == [] and item in summary["not_run"]
    top, checks = md.split("## Checks")
    assert top.startswith("# GPU check: INCOMPLETE") and "Did not run" in top
    assert any(line.startswith(f"- {item}: ") and why in line for line in top.splitlines())  # listed, with its reason
    assert f"✓ {item}:" not in md and f"- met: {item}" not in md
    if not item.startswith("target: "):
        assert f"- – {item}: " in checks


def test_a_test_that_failed_beside_one_skipped_fails_the_check_and_names_the_skip(tmp_path):
    _write_run(tmp_path / "out", skip_reason="TensorRT is not installed", pytest_failures=1)
    code, summary, _ = _summary(tmp_path / "out")
    check = next(c for c in summary["checks"] if c["check"] == "pytest -m gpu")
    assert code == 1 and check["status"] == "failed" and "TensorRT is not installed" in check["detail"]


def test_a_step_past_its_own_limit_failed(tmp_path):
    _write_run(tmp_path / "out", steps={"bench_ragged_decode": "124\t150\t0"})
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
                                    {"steps": {"bench_cuda": "124\t150\t0"}}, {"ragged_exact": False}])
def test_any_failed_check_fails_the_run(tmp_path, broken):
    _write_run(tmp_path / "out", **broken)
    assert gpu_check_summary.main([str(tmp_path / "out")]) == 1
    summary = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert summary["verdict"] == "failed" and summary["failed"]
