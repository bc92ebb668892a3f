"""The engine level's own logic: what it compares, what it calls passed (no engine runs here; the real
SGLang runs are tests/integrations/sglang/test_engine.py)."""

from __future__ import annotations

import json

import pytest

from kvzap_export.errors import ConfigError
from kvzap_export.validate.engine_level import engine_python, load_prompts, summarize

REFERENCE = {"schema": "kvzap-export-reference/1", "max_new_tokens": 4,
             "prompts": [{"source": "a", "prompt_ids": [1, 2, 3], "runs": [{"decoding": False, "output_ids": [7, 8, 9, 10]},
                                                                         {"decoding": True, "output_ids": [7, 8, 5, 5]}]}]}


def reading(slots, decided=None, layers=2, heads=2, **extra):
    out = {"slots_held": slots, "layers": layers, "kv_heads": heads, **extra}
    if decided is not None:
        out["decided_entries"] = decided
    return out


def raw(outputs: dict, readings: dict, mode: str = "evict") -> dict:
    """The driver's result; each reading says which run it comes from, as the plugin writes it."""
    results = []
    for run in ("off", "prefill", "decoding"):
        line = readings[run]
        if line is not None:
            line = {"mode": mode, "kvzap": run != "off", "decoding": None if run == "off" else run == "decoding", **line}
        results.append({"prompt": 0, "prompt_ids": [1, 2, 3], "run": run, "output_ids": outputs[run], "reading": line})
    return {"engine": {"sglang": "0.5.23"}, "results": results}


def test_identical_tokens_pass_and_kv_comes_from_the_readings():
    r = raw({"off": [7, 8, 9, 11], "prefill": [7, 8, 9, 10], "decoding": [7, 8, 5, 5]},
            {"off": reading(6), "prefill": reading(6, 24), "decoding": reading(5, 20)})
    result = summarize(r, REFERENCE, "evict", 4, ["a"])
    assert result["status"] == "passed" and result["matching"] == 2
    rows = {row["decoding"]: row for row in result["prompts"]}
    assert rows[True]["kv_held"] == 20 and rows[True]["kv_dense"] == 24 and rows[True]["freed_fraction"] == pytest.approx(1 / 6)
    assert rows[False]["reference_differs_from_dense"] is True


def test_a_different_token_fails_and_says_where():
    r = raw({"off": [7, 8, 9, 10], "prefill": [7, 8, 9, 10], "decoding": [7, 8, 9, 10]},
            {"off": reading(6), "prefill": reading(6, 24), "decoding": reading(6, 24)}, mode="mask")
    result = summarize(r, REFERENCE, "mask", 4, ["a"])
    assert result["status"] == "failed" and "at step 2" in result["problems"][0]
    assert next(row for row in result["prompts"] if row["decoding"])["first_mismatch"] == 2


def test_held_entries_that_differ_from_the_decisions_fail():
    r = raw({"off": [7, 8, 9, 11], "prefill": [7, 8, 9, 10], "decoding": [7, 8, 5, 5]},
            {"off": reading(6), "prefill": reading(6, 20), "decoding": reading(5, 20)})
    result = summarize(r, REFERENCE, "evict", 4, ["a"])
    assert result["status"] == "failed" and "holds 24 entries, the decisions imply 20" in result["problems"][0]


def test_ragged_mode_reads_the_per_head_pool():
    r = raw({"off": [7, 8, 9, 11], "prefill": [7, 8, 9, 10], "decoding": [7, 8, 5, 5]},
            {"off": reading(6, head_slots_held=24), "prefill": reading(6, 13, head_slots_held=13),
             "decoding": reading(6, 11, head_slots_held=11)}, mode="ragged")
    result = summarize(r, REFERENCE, "ragged", 4, ["a"])
    # the per-head pool for both: SGLang's slot ids carry no K/V in this mode
    assert result["status"] == "passed" and result["kv_held"] == 24 and result["kv_dense"] == 48


def test_ragged_mode_reports_the_engines_cuda_graph_replays_and_tau():
    """The readings' cumulative count of decode steps that replayed a CUDA graph (its largest: the last) and the τ in
    effect go into the result and its report; modes whose readings lack them report neither."""
    lines = {"off": reading(6, head_slots_held=24, decode_graph_replays=3, threshold=-1.5),
             "prefill": reading(6, 13, head_slots_held=13, decode_graph_replays=9, threshold=-1.5),
             "decoding": reading(6, 11, head_slots_held=11, decode_graph_replays=14, threshold=-1.5)}
    outputs = {"off": [7, 8, 9, 11], "prefill": [7, 8, 9, 10], "decoding": [7, 8, 5, 5]}
    result = summarize(raw(outputs, lines, mode="ragged"), REFERENCE, "ragged", 4, ["a"])
    assert result["decode_graph_replays"] == 14 and result["threshold_in_effect"] == [-1.5]
    zero = {run: {**line, "decode_graph_replays": 0} for run, line in lines.items()}
    assert summarize(raw(outputs, zero, mode="ragged"), REFERENCE, "ragged", 4, ["a"])["decode_graph_replays"] == 0
    evict = summarize(raw(outputs, {"off": reading(6), "prefill": reading(6, 24), "decoding": reading(5, 20)}), REFERENCE,
                      "evict", 4, ["a"])
    assert "decode_graph_replays" not in evict and "threshold_in_effect" not in evict


def test_the_report_names_the_replay_count(tmp_path):
    from kvzap_export.validate.engine_level import write_engine_report

    result = {"status": "passed", "engine": "sglang", "mode": "ragged", "summary": "ok", "prompts": [], "problems": [],
              "decode_graph_replays": 0, "threshold_in_effect": [0.0]}
    text = write_engine_report(tmp_path, result).read_text()
    assert "Decode steps that replayed a CUDA graph (the engine's count since launch): 0; τ in effect: [0.0]." in text


def test_without_a_reference_nothing_is_called_passed():
    r = raw({"off": [1], "prefill": [2], "decoding": [3]}, {"off": reading(1), "prefill": reading(1), "decoding": reading(1)},
            mode="mask")
    result = summarize(r, None, "mask", 1, ["--prompts entry 1"])
    assert result["status"] == "skipped" and all(row["matches_reference"] is None for row in result["prompts"])
    assert "no kvpress reference" in result["reason"]


def test_prompts_and_engine_python_are_checked(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="carries no kvpress reference"):
        load_prompts(None, None)
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"a": 1}))
    with pytest.raises(ConfigError, match="JSON list of non-empty strings"):
        load_prompts(str(bad), REFERENCE)
    good = tmp_path / "q.json"
    good.write_text(json.dumps(["hello"]))
    assert load_prompts(str(good), None) == [{"text": "hello", "source": "--prompts entry 1"}]
    assert load_prompts(None, REFERENCE)[0]["input_ids"] == [1, 2, 3]
    monkeypatch.delenv("KVZAP_SGLANG_PYTHON", raising=False)
    with pytest.raises(ConfigError, match="no such interpreter"):
        engine_python(str(tmp_path / "python"))


@pytest.mark.parametrize("broken, says", [
    ({"decoding": None}, "no reading from the engine"),
    ({"decoding": {"slots_held": 5, "layers": 2, "kv_heads": 2, "mode": "evict", "kvzap": False}}, "left the request alone"),
    ({"prefill": {"slots_held": 6, "layers": 2, "kv_heads": 2, "mode": "evict", "kvzap": True, "decoding": True,
                  "decided_entries": 24}}, "decoding=True"),
    ({"off": {"slots_held": 6, "layers": 2, "kv_heads": 2, "mode": "mask", "kvzap": False}}, "mask server"),
])
def test_tokens_without_a_matching_kvzap_reading_never_pass(broken, says):
    """kvpress's tokens can equal dense ones: matching tokens alone would pass a server where KVzap never ran."""
    r = raw({"off": [7, 8, 9, 11], "prefill": [7, 8, 9, 10], "decoding": [7, 8, 5, 5]},
            {"off": reading(6), "prefill": reading(6, 24), "decoding": reading(5, 20)})
    for run, line in broken.items():
        next(x for x in r["results"] if x["run"] == run)["reading"] = line
    result = summarize(r, REFERENCE, "evict", 4, ["a"])
    assert result["status"] == "failed" and any(says in p for p in result["problems"]), result["problems"]


def test_a_reference_from_other_settings_is_refused():
    from kvzap_export.validate.engine_level import check_reference

    manifest = {"pruning": {"threshold": -4.0, "window": 128}, "surrogate": {"variant": "mlp", "sha256": "aa"}}
    good = {"press": {"threshold": -4.0, "sliding_window_size": 128, "variant": "mlp", "surrogate_sha256": "aa"}}
    check_reference(good, manifest)
    with pytest.raises(ConfigError, match="threshold -3.0 vs -4.0.*surrogate weights differ"):
        check_reference({"press": {**good["press"], "threshold": -3.0, "surrogate_sha256": "bb"}}, manifest)


def test_tensor_parallel_readings_sum_the_ranks_and_each_rank_must_hold_what_its_heads_decide():
    """Under tensor parallelism the driver's reading carries every rank's (each holds its own heads): the figures are
    their sums, and a rank whose own pool differs from its own heads' decisions fails even when the sums agree."""
    def ranked(*ranks):
        return {**ranks[0], "ranks": [{**r, "tp_rank": i} for i, r in enumerate(ranks)]}

    def run(second_rank_held):
        r = raw({"off": [7, 8, 9, 11], "prefill": [7, 8, 9, 10], "decoding": [7, 8, 5, 5]},
                {"off": ranked(reading(6, head_slots_held=12, heads=1), reading(6, head_slots_held=12, heads=1)),
                 "prefill": ranked(reading(6, 7, head_slots_held=7, heads=1), reading(6, 6, head_slots_held=6, heads=1)),
                 "decoding": ranked(reading(6, 5, head_slots_held=5, heads=1),
                                    reading(6, 6, head_slots_held=second_rank_held, heads=1))}, mode="ragged")
        return summarize(r, REFERENCE, "ragged", 4, ["a"])

    good = run(6)
    assert good["status"] == "passed" and good["kv_held"] == 13 + 11 and good["kv_dense"] == 48
    assert {row["decoding"]: row["kv_held_per_rank"] for row in good["prompts"]} == {False: [7, 6], True: [5, 6]}
    # rank 1 holds one entry more than its heads imply, rank 0 one fewer (made up): the sums agree, the ranks do not
    r = raw({"off": [7, 8, 9, 11], "prefill": [7, 8, 9, 10], "decoding": [7, 8, 5, 5]},
            {"off": ranked(reading(6, head_slots_held=12, heads=1), reading(6, head_slots_held=12, heads=1)),
             "prefill": ranked(reading(6, 7, head_slots_held=7, heads=1), reading(6, 6, head_slots_held=6, heads=1)),
             "decoding": ranked(reading(6, 5, head_slots_held=4, heads=1), reading(6, 6, head_slots_held=7, heads=1))},
            mode="ragged")
    bad = summarize(r, REFERENCE, "ragged", 4, ["a"])
    assert bad["status"] == "failed" and any("rank 1 holds 7, its decisions imply 6" in p for p in bad["problems"])
    assert run(7)["status"] == "failed"
