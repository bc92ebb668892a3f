"""The bench suites on a CPU: what an engine runs is what is timed, and a part this machine lacks keeps its row with
the reason (a GPU, onnxruntime-extensions, kvpress and the model)."""

import importlib
import sys

import pytest
import torch

from kvzap_export.bench import compaction, overhead, run, scoring
from kvzap_export.integrations.scoring import BundleScorer
from kvzap_export.surrogate.model import Surrogate, SurrogateConfig


def test_decode_overhead_times_the_per_step_decision_not_a_compaction(monkeypatch):
    calls = []
    from kvzap_export.kernels import decode_decision
    from kvzap_export.kernels import torch_ops

    real = decode_decision.decide_table
    monkeypatch.setattr(decode_decision, "decide_table", lambda *a, **k: (calls.append(a[3].shape), real(*a, **k))[1])
    monkeypatch.setattr(torch_ops, "threshold_compaction", lambda *a, **k: pytest.fail("a compaction was timed at decode"))
    scorers = {"mlp": BundleScorer(Surrogate(SurrogateConfig(4096, 8, 1, 512)))}
    rows = overhead._decode_rows(overhead.AttentionBlock().eval(), scorers, "cpu", torch.float32, 1024,
                                 {"benchmark": "overhead", "layers_per_call": 2})
    (row,) = rows
    assert calls and all(shape == (1, 2, overhead.KV_HEADS) for shape in calls)  # the engine's call: every layer's rows
    assert row["phase"] == "decode" and row["decision_s"] > 0 and "compaction_s" not in row
    assert row["overhead_time_pct"] == pytest.approx(100 * (row["scoring_s"] + row["decision_s"]) / row["attention_s"])
    assert row["graphed"].startswith("skipped") and "CUDA" in row["graphed"]


def test_prefill_overhead_rows_name_the_compaction_and_skip_gpu_launchers_on_a_cpu():
    rows = overhead.bench_overhead("cpu", prefill=(256,), decode_cache=512)
    prefill = [r for r in rows if r["phase"] == "prefill"]
    assert {r["compaction"] for r in prefill} == {"torch reference (engines' CPU path)", "Triton fused launcher",
                                                  "CUDA library fused launcher"}
    assert all(r["skipped"] == "needs a CUDA GPU" for r in prefill if r["compaction"] != "torch reference (engines' CPU path)")
    assert all(r["dtype"] == "float32" for r in rows)  # a CPU runs float32; a GPU the model's bfloat16
    assert {r["phase"] for r in rows} == {"prefill", "decode"}


def test_scoring_rows_say_which_path_the_engines_use_and_do_not_compile_by_default(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("torch.compile ran by default"))
    rows = scoring.bench_scoring("cpu", tokens=(1,))
    ran = [r for r in rows if "skipped" not in r]
    assert {r["backend"] for r in ran} == {"torch_eager", "onnxruntime"}
    assert all(r["used_by_engines"] == (r["backend"] == "torch_eager") for r in ran)
    assert {r["backend"] for r in rows if "skipped" in r} == {"torch_graphed"}


def test_the_plugin_node_row_is_skipped_without_onnxruntime_extensions(monkeypatch):
    from kvzap_export.runners import onnxrt

    monkeypatch.setitem(sys.modules, "onnxruntime_extensions", None)  # import fails as if not installed
    # the uncached function: the process's registered ops stay as they are (registering them twice fails in ORT)
    monkeypatch.setattr(onnxrt, "_define_ops", onnxrt._define_ops.__wrapped__)
    rows = compaction.bench_compaction("cpu", lengths=(1024,))
    plugin = next(r for r in rows if r["backend"] == "ort_plugin_node")
    assert "onnxruntime-extensions" in plugin["skipped"] and "median_s" not in plugin
    assert next(r for r in rows if r["backend"] == "ort_std_ops")["median_s"] > 0


def test_a_suite_missing_an_optional_part_is_skipped_with_the_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "kvpress", None)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "kvpress" else real(name, *a))
    report = run.run_bench("cpu", ("e2e",))
    (row,) = report["results"]["e2e"]
    assert row["benchmark"] == "e2e" and "kvpress" in row["skipped"] and "pip install" in row["skipped"]


def test_a_suite_that_raises_keeps_the_others_figures_and_fails_the_command(monkeypatch, capsys):
    import json

    from kvzap_export.cli.main import main

    real = run._suites

    def suites(device, compile_scoring=False):
        out = real(device, compile_scoring)
        out["scoring"] = lambda: (_ for _ in ()).throw(RuntimeError("graph capture failed"))
        out["compaction"] = lambda: [{"benchmark": "compaction", "seq": 1, "median_s": 1.0}]
        return out

    monkeypatch.setattr(run, "_suites", suites)
    assert main(["bench", "--only", "scoring,compaction", "--json"]) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["errors"] == ["scoring"] and report["results"]["compaction"][0]["median_s"] == 1.0
    assert report["results"]["scoring"] == [{"benchmark": "scoring", "error": "RuntimeError: graph capture failed"}]
    assert captured.err.count("\n") == 1 and "scoring" in captured.err
