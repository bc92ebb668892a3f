"""gpu_check.sh's SGLang steps (step 8) and their part of the summary (scripts/gpu_check_engine.py): the summary on
files written by hand (tests/gpu_check_engine_files.py: plumbing, not a GPU measurement), and the script itself run
with a stand-in interpreter that answers as a GPU machine would and records every command it is given: without the
engine folders each engine step is recorded as not run, with why; with them, the commands and environment the steps
pass to validate, bench and the dummy-bundle builder."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu_check_engine_files import bench, parity
from tests.test_gpu_check_script import GPU, _summary, _write_run

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
sys.path.insert(0, str(REPO / "scripts"))

import gpu_check_engine  # noqa: E402

RAGGED_REPLAYS = "SGLang ragged mode, tiny Llama: decode steps replayed a CUDA graph"
LLAMA_MASK = "SGLang engine parity, tiny Llama, mask mode: SGLang's greedy tokens vs kvpress's (computed on a CPU)"


def test_every_engine_check_passes_and_the_targets_say_share_running_and_rounds(tmp_path):
    _write_run(tmp_path / "out")
    code, summary, md = _summary(tmp_path / "out")
    assert code == 0 and summary["verdict"] == "passed"
    engine = [c for c in summary["checks"] if c["check"].startswith("SGLang")]
    assert len(engine) == 6 + 2 + 2 and all(c["status"] == "passed" for c in engine)  # parity, replays, bench replays
    assert {f"step:{name}" for name in gpu_check_engine.ENGINE_STEPS} <= {c["check"] for c in summary["checks"]}
    targets = {t["target"]: t for t in summary["targets"]}
    seventy = targets["ragged at 70% pruned vs dense, output tokens/s (8k prompts, Llama-3.1-8B shapes, bf16)"]
    forty = targets["ragged at 40% pruned vs dense, output tokens/s (8k prompts, Llama-3.1-8B shapes, bf16)"]
    assert seventy["value"] == pytest.approx(1.8) and seventy["met"] is True
    assert forty["value"] == pytest.approx(1.1) and forty["met"] is False  # reported: the verdict stays passed
    assert "KVzap's own share (vs ragged, KVzap off) 1.89x" in seventy["note"]
    assert "requests running at most: dense 3, ragged, 70% pruned 9, ragged, KVzap off 3" in seventy["note"]
    assert "one run per configuration, not a median" in seventy["note"] and "meaningless scores" in seventy["note"]
    rows = [f for f in summary["figures"] if f["source"].startswith("SGLang stream")]
    assert len(rows) == 4 + 2 and all(r["device"] == GPU for r in rows)
    assert {r["config"]: r["gpu_gb_at_end"] for r in rows if r["pruned_fraction"] == 0.4} == {"ragged, 40% pruned": 30.0}
    assert rows[0]["sglang_static_plan_gb"] == pytest.approx(112.0)
    assert "MISSED: ragged at 40% pruned" in md and "KVzap's own share" in md


@pytest.mark.parametrize("engine, item", [
    ({"replays": 0}, RAGGED_REPLAYS),  # ragged mode replayed no decode graph: its fast path did not run
    ({"parity_status": {("llama", "mask"): "failed"}}, LLAMA_MASK),  # a token differs from kvpress's
    ({"parity_status": {("llama", "mask"): "failed"}}, "step:engine_parity_llama_mask"),
    ({"bench_replays": 0}, "SGLang stream benchmark (engine-bench-8k.json): ragged runs replayed decode CUDA graphs"),
])
def test_a_failed_engine_check_fails_the_run(tmp_path, engine, item):
    _write_run(tmp_path / "out", engine=engine)
    code, summary, md = _summary(tmp_path / "out")
    assert code == 1 and item in summary["failed"]
    assert f"✗ {item}" in md


@pytest.mark.parametrize("engine, steps, item, why", [
    ({"absent": ("engine_parity_qwen3_evict.json",)}, {},
     "SGLang engine parity, tiny Qwen3, evict mode: SGLang's greedy tokens vs kvpress's (computed on a CPU)", "is absent"),
    ({"replays": None}, {}, RAGGED_REPLAYS, "no replay count"),
    ({"parity_status": {("qwen3", "ragged"): "skipped"}}, {}, "step:engine_parity_qwen3_ragged", "incomplete"),
    ({}, {"engine_bench_32k": "missing\t0\t0"}, "step:engine_bench_32k", "not on this machine"),
    ({"absent": ("engine-bench-8k.json",)}, {"engine_bench_8k": "124\t300\t1"},
     "target: ragged at 70% pruned vs dense, output tokens/s (8k prompts, Llama-3.1-8B shapes, bf16)", "not measured"),
    ({}, {"engine_install": None}, "step:engine_install", "not in steps.tsv"),
])
def test_an_engine_check_that_did_not_run_is_listed_never_passed(tmp_path, engine, steps, item, why):
    _write_run(tmp_path / "out", engine=engine, steps=steps)
    code, summary, md = _summary(tmp_path / "out")
    assert code == 3 and summary["failed"] == [] and item in summary["not_run"]
    top = md.split("## Checks")[0]
    assert any(line.startswith(f"- {item}: ") and why in line for line in top.splitlines()), top
    assert f"✓ {item}" not in md


def test_the_parity_rows_and_bench_rows_read_what_validate_and_bench_write():
    """The keys the summary reads are the ones validate --json and bench --json write (their own tests pin those)."""
    assert {"status", "summary", "problems", "decode_graph_replays", "threshold_in_effect"} <= set(parity("ragged"))
    assert {"tokens_per_s", "max_running", "decode_graph_replays"} <= set(bench(8192)["runs"][1]["figures"])


# The stand-in interpreter: answers the GPU probe, records every kvzap-export / prepare_engine_check command with the
# environment the engine steps set, answers validate and bench with the files above, runs everything else for real.
STANDIN = """#!/usr/bin/env bash
if [ "$1" = "-c" ]; then exit 0; fi
case "$*" in
  *"kvzap_export.cli.main validate"*|*"kvzap_export.cli.main bench"*|*"prepare_engine_check.py --dummy-bundle"*)
    printf '%s\\t%s\\t%s\\n' "${PYTHONPATH}" "${SGLANG_FORCE_FUSED_OP_BACKEND-unset}" "$*" >> "$CALLS"
    case "$*" in
      *validate*) args=" $* "; mode="${args#* --engine-mode }"; cat "$ANSWERS/parity-${mode%% *}.json" ;;
      *"--prompt-tokens 8192"*) cat "$ANSWERS/bench-8k.json" ;;
      *bench*) cat "$ANSWERS/bench-32k.json" ;;
    esac ;;
  *) exec "$REAL" "$@" ;;
esac
"""


def _run_script(tmp_path, **env) -> tuple[subprocess.CompletedProcess, Path]:
    answers = tmp_path / "answers"
    answers.mkdir()
    for mode in ("ragged", "mask", "evict"):
        (answers / f"parity-{mode}.json").write_text(json.dumps(parity(mode)))
    (answers / "bench-8k.json").write_text(json.dumps(bench(8192)))
    (answers / "bench-32k.json").write_text(json.dumps(bench(32768)))
    python = tmp_path / "python3"
    python.write_text(STANDIN)
    python.chmod(0o755)
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": str(python), "REAL": sys.executable, "ANSWERS": str(answers),
                               "CALLS": str(tmp_path / "calls.tsv"), "GPU_CHECK_STEPS": "engine",
                               "GPU_CHECK_WORK": str(tmp_path / "work"), **env})
    return done, out


def test_without_the_engine_folders_every_engine_step_is_not_run_with_why(tmp_path):
    done, out = _run_script(tmp_path, KVZAP_SGLANG_ENGINE=str(tmp_path / "nowhere"))
    assert done.returncode == 3, done.stderr
    md = (out / "gpu-check.md").read_text()
    top = md.split("## Checks")[0]
    assert md.startswith("# GPU check: INCOMPLETE")
    for name in gpu_check_engine.ENGINE_STEPS:
        assert f"- step:{name}: no SGLang bundle at {tmp_path / 'nowhere'}" in top
    assert "- step:bench_cuda: not selected (GPU_CHECK_STEPS=engine)" in top
    assert not (tmp_path / "calls.tsv").exists()  # nothing was started


def test_the_engine_steps_pass_the_right_commands_and_environment(tmp_path):
    engine, check = tmp_path / "engine", tmp_path / "check"
    engine.mkdir()
    (engine / "install.sh").write_text('#!/usr/bin/env bash\nmkdir -p "$1" && echo "export PYTHONPATH=$1"\n')
    (engine / "install.sh").chmod(0o755)
    for part in ("tiny-llama/bundle", "tiny-qwen3/bundle", "llama-3.1-8b"):
        (check / part).mkdir(parents=True)
    (check / "manifest.json").write_text(json.dumps({"kvzap_export_commit": "abc"}))
    done, out = _run_script(tmp_path, KVZAP_SGLANG_ENGINE=str(engine), KVZAP_ENGINE_CHECK=str(check))
    assert done.returncode == 3, done.stderr  # the kernel steps were not selected
    summary = json.loads((out / "gpu-check.json").read_text())
    # only the kernel part did not run: its steps (not selected), what they would have measured, no engine item
    steps = [n for n in summary["not_run"] if n.startswith("step:")]
    assert len(steps) == 7 and all("not selected" in (out / f"{n[5:]}.log").read_text() for n in steps)
    assert not [n for n in summary["not_run"] if "engine" in n or "SGLang" in n or "ragged at" in n]
    engine_checks = [c for c in summary["checks"] if c["check"].startswith(("SGLang", "step:engine"))]
    assert engine_checks and all(c["status"] == "passed" for c in engine_checks)
    calls = [line.split("\t") for line in (tmp_path / "calls.tsv").read_text().splitlines()]
    site, plugin = f"{tmp_path / 'work'}/site", f"{check}/plugin"
    validates = [shlex.split(c[2]) for c in calls if " validate " in c[2]]
    engine_calls = [c for c in calls if " validate " in c[2] or " bench " in c[2]]
    assert len(validates) == 6 and len(engine_calls) == 8
    assert all(c[0].endswith(f":{site}:{plugin}") and c[1] == "torch" for c in engine_calls)
    assert sorted((v[v.index("--engine-mode") + 1], Path(v[v.index("--model") + 1]).parent.name) for v in validates) == \
        sorted((mode, f"tiny-{m}") for mode in ("ragged", "mask", "evict") for m in ("llama", "qwen3"))
    for v in validates:
        assert v[v.index("--device") + 1] == "cuda" and "--json" in v
        assert [v[i + 1] for i, a in enumerate(v) if a == "--engine-arg"] == ["sampling_backend=pytorch",
                                                                               "mem_fraction_static=0.3"]
    benches = [shlex.split(c[2]) for c in calls if " bench " in c[2]]
    assert [b[b.index("--prompt-tokens") + 1] for b in benches] == ["8192", "32768"]
    eight = benches[0]
    for flag, value in (("--device", "cuda"), ("--load-format", "dummy"), ("--dense-backend", "triton"),
                        ("--pruned-fraction", "0.7,0.4"), ("--configs", "dense,ragged,ragged-off"), ("--rounds", "1"),
                        ("--bundle", f"{tmp_path / 'work'}/llama-3.1-8b-bundle"), ("--model", f"{check}/llama-3.1-8b"),
                        ("--save-runs", f"{out.resolve()}/engine-bench-8k.runs.jsonl")):
        assert eight[eight.index(flag) + 1] == value, flag
    dummy = next(shlex.split(c[2]) for c in calls if "--dummy-bundle" in c[2])
    assert dummy[dummy.index("--config") + 1] == f"{check}/llama-3.1-8b"
    assert json.loads((out / "engine-settings.json").read_text())["fused_op_backend"] == "torch"


def test_the_jit_setting_leaves_sglangs_fused_ops_to_sglang(tmp_path):
    engine, check = tmp_path / "engine", tmp_path / "check"
    engine.mkdir()
    (engine / "install.sh").write_text('#!/usr/bin/env bash\nmkdir -p "$1"\n')
    (engine / "install.sh").chmod(0o755)
    check.mkdir()
    (check / "manifest.json").write_text("{}")
    _run_script(tmp_path, KVZAP_SGLANG_ENGINE=str(engine), KVZAP_ENGINE_CHECK=str(check),
                KVZAP_SGLANG_FUSED_OP_BACKEND="jit", SGLANG_FORCE_FUSED_OP_BACKEND="torch")
    calls = [line.split("\t") for line in (tmp_path / "calls.tsv").read_text().splitlines()]
    assert calls and all(c[1] == "unset" for c in calls if " validate " in c[2] or " bench " in c[2])


def test_a_throughput_run_that_failed_fails_the_check_and_keeps_the_others_rows(tmp_path):
    _write_run(tmp_path / "out", steps={"engine_bench_32k": "1\t90\t0"})
    report = bench(32768)
    report["runs"] = report["runs"][1:]  # dense did not launch: the ragged run's row stays
    report["errors"] = [{"round": 1, "label": "dense", "error": "NotImplementedError: a stand-in op"}]
    (tmp_path / "out" / "engine-bench-32k.json").write_text(json.dumps(report))
    code, summary, _ = _summary(tmp_path / "out")
    failed = next(c for c in summary["checks"] if c["check"].endswith("(engine-bench-32k.json): runs that failed"))
    assert code == 1 and failed["status"] == "failed" and "dense: NotImplementedError" in failed["detail"][0]
    assert [r["config"] for r in summary["figures"] if "32768 prompt tokens" in r["source"]] == ["ragged, 70% pruned"]


def test_a_benchmark_cut_short_reports_the_runs_it_saved_and_is_not_a_pass(tmp_path):
    """engine_bench_8k stopped by its limit before writing its report: the runs --save-runs kept are rows, the target
    is computed from the ones that ran (dense and ragged at 70%), the one whose run is missing is not measured."""
    _write_run(tmp_path / "out", engine={"absent": ("engine-bench-8k.json",)}, steps={"engine_bench_8k": "124\t300\t0"})
    report = bench(8192)
    lines = [{"settings": report["settings"], "machine": GPU}, *report["runs"][:2]]
    (tmp_path / "out" / "engine-bench-8k.runs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, summary, md = _summary(tmp_path / "out")
    assert code == 1 and "step:engine_bench_8k" in summary["failed"]  # past its own limit
    assert "SGLang stream benchmark (engine-bench-8k.json): the whole benchmark" in summary["not_run"]
    rows = [f for f in summary["figures"] if "8192 prompt tokens (partial" in f["source"]]
    assert [r["config"] for r in rows] == ["dense", "ragged, 70% pruned"]
    targets = {t["target"].split(" vs")[0]: t for t in summary["targets"] if "8k prompts" in t["target"]}
    assert targets["ragged at 70% pruned"]["value"] == pytest.approx(1.8)
    assert targets["ragged at 40% pruned"]["met"] is None and "KVzap's own share: no ragged, KVzap off run" in \
        targets["ragged at 70% pruned"]["note"]
