"""Interleaved timing: ratios taken within rounds, every implementation measured in every round."""

import time

import pytest

from kvzap_export.bench.timing import measure, measure_interleaved


def test_interleaved_ratio_reflects_the_relative_cost():
    calls = {"slow": 0, "fast": 0}

    def slow():
        calls["slow"] += 1
        time.sleep(0.004)

    def fast():
        calls["fast"] += 1
        time.sleep(0.001)

    result = measure_interleaved({"slow": slow, "fast": fast}, rounds=4, min_seconds=0.05)
    assert result["slow"]["ratio_vs_first"] == 1.0 and result["slow"]["rounds"] == result["fast"]["rounds"] == 4
    assert 2.0 < result["fast"]["ratio_vs_first"] < 5.0  # 4 ms / 1 ms, less the sleep overshoot
    assert result["fast"]["median_s"] < result["slow"]["median_s"]
    assert calls["slow"] >= 5 and calls["fast"] >= 5  # one warm-up, then at least one call per round


def test_measure_without_warmup_counts_every_call():
    calls = []
    timing = measure(lambda: calls.append(1), min_seconds=0.0, min_repeats=3, warmup=False)
    assert len(calls) == 3 and timing["repeats"] == 3


def test_scoring_rows_carry_in_run_ratios():
    from kvzap_export.bench.scoring import bench_scoring

    rows = [r for r in bench_scoring(tokens=(1,), compile_torch=False) if "skipped" not in r]
    assert {(r["variant"], r["backend"]) for r in rows} == {(v, b) for v in ("linear", "mlp") for b in ("torch_eager", "onnxruntime")}
    for row in rows:
        assert row["median_s"] > 0 and row["tokens_per_s"] == pytest.approx(1 / row["median_s"])
        assert row["ratio_vs_eager"] > 0 and (row["backend"] != "torch_eager" or row["ratio_vs_eager"] == 1.0)
