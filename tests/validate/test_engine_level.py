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


def raw(outputs: dict, readings: dict) -> dict:
    results = [{"prompt": 0, "prompt_ids": [1, 2, 3], "run": run, "output_ids": outputs[run], "reading": readings[run]}
               for run in ("off", "prefill", "decoding")]
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
            {"off": reading(6), "prefill": reading(6, 24), "decoding": reading(6, 24)})
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
            {"off": reading(6), "prefill": reading(0, 13, head_slots_held=13),
             "decoding": reading(0, 11, head_slots_held=11)})
    result = summarize(r, REFERENCE, "ragged", 4, ["a"])
    assert result["status"] == "passed" and result["kv_held"] == 24 and result["kv_dense"] == 48


def test_without_a_reference_nothing_is_called_passed():
    r = raw({"off": [1], "prefill": [2], "decoding": [3]}, {"off": reading(1), "prefill": reading(1), "decoding": reading(1)})
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
