"""KVzap inside the real SGLang 0.5.23 engine on the CPU with several scheduler processes: tensor parallelism
(``--tp-size 2``: each rank holds, scores and decides its own KV heads; SGLang's CPU engine all-reduces through gloo)
and data parallelism (``--dp-size 2``: two replicas). On this 2-core machine the driver binds one core to each rank.

Models whose KV heads split over 2 ranks: the tiny Qwen3 (2 KV heads: one a rank) and the tiny Llama (4: two a rank).
"""

from __future__ import annotations

import json
import random
from collections import defaultdict

import pytest

from tests.integrations.sglang.engine_runs import reference_prompts, reference_stream, run_driver
from tests.integrations.sglang.test_engine import check_against_kvpress, engine_level, why

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


@pytest.mark.parametrize("which", ["qwen3", "llama"])
@pytest.mark.parametrize("mode", ["ragged", "mask", "evict"])
def test_two_tensor_parallel_ranks_give_kvpress_tokens_and_each_holds_what_its_heads_decide(request, capsys, which,
                                                                                           mode):
    """``validate --engine sglang --tp-size 2``: SGLang's defaults otherwise (ragged mode: radix cache, chunked prefill,
    overlap scheduler). Every run gives kvpress's tokens (the same reference the one-rank runs of test_engine.py equal),
    and each rank's own pool holds what its own heads' decisions imply (the engine level compares them rank by rank)."""
    model, bundle = request.getfixturevalue(which)
    code, result = engine_level(capsys, model, bundle, mode, "--tp-size", "2")
    assert code == 0, why(result)
    check_against_kvpress(result, reference_prompts(bundle))
    assert result["engine_info"]["args"]["tp_size"] == 2
    for row in result["prompts"]:
        per_rank = row["kv_held_per_rank"]
        assert len(per_rank) == 2 and sum(per_rank) == row["kv_held"], row
        if mode != "mask":
            assert row["kv_held"] == row["decided_entries"] < row["kv_dense"], row
    if mode == "ragged":
        assert result["engine_info"]["resolved"]["disable_radix_cache"] is False


@pytest.mark.parametrize("mode", ["ragged", "mask", "evict"])
def test_the_tiny_llama_at_one_rank_gives_the_same_kvpress_tokens(llama, capsys, mode):
    """The tiny Llama's one-rank runs (test_engine.py covers the tiny Qwen3's): the same reference tokens as its
    two-rank runs above, so one and two ranks give the same tokens in every mode."""
    model, bundle = llama
    code, result = engine_level(capsys, model, bundle, mode)
    assert code == 0, why(result)
    check_against_kvpress(result, reference_prompts(bundle))
    assert all("kv_held_per_rank" not in row for row in result["prompts"])


@pytest.fixture(scope="module")
def lopsided(qwen3, tmp_path_factory):
    """The tiny Qwen3 with a surrogate whose head 0 (tensor-parallel rank 0's) scores every token -100 and head 1 (rank
    1's) +100, τ = 0, an 8-token window: rank 0 keeps only each request's last 8 tokens, rank 1 every token."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from kvzap_export.model_dirs import SURROGATE_DIR

    model, _ = qwen3
    root = tmp_path_factory.mktemp("lopsided")
    surrogate = root / "surrogate"
    shutil.copytree(model / SURROGATE_DIR, surrogate)
    weights = load_file(surrogate / "model.safetensors")
    for name in [n for n in weights if n.endswith(".2.weight")]:
        weights[name] = torch.zeros_like(weights[name])
        weights[name.replace("weight", "bias")] = torch.tensor([-100.0, 100.0])
    save_file(weights, surrogate / "model.safetensors")
    from kvzap_export.pipeline import ExportOptions, run_pipeline

    out = root / "bundle"
    run_pipeline(ExportOptions(model=str(model), out=out, check=False, weights=str(surrogate), threshold=0.0,
                               window=8))
    return model, out


def _by_rank(readings: list[dict]) -> dict[int, list[dict]]:
    out = defaultdict(list)
    for r in readings:
        out[r["tp_rank"]].append(r)
    return out


def test_admission_follows_the_fuller_rank_and_every_rank_gets_every_entry_back(lopsided, qwen3, tmp_path):
    """200 requests of mixed lengths and settings, half starting with one of three shared prefixes, a fifth aborted,
    submitted at once to a small pool at ``--tp-size 2`` with the lopsided surrogate: rank 1 keeps every token, rank 0
    little. SGLang's ranks admit on one figure; it must be rank 1's (the fuller): with rank 0's, or the larger of the
    two, rank 1's pool would run out (its store raises, the scheduler dies). Checked: every request ends; at every step
    both ranks' schedulers saw the same room, never more than rank 1's own; rank 1 filled its pool while rank 0 held far
    less; once idle, on every rank no row holds an entry and every entry is free or the tree's."""
    model, bundle = lopsided
    ids = [i for p in reference_prompts(qwen3[1]) for i in p]
    rng = random.Random(0)
    shared = [rng.randint(0, len(ids) - 300) for _ in range(3)]
    stream = []
    for i in range(200):
        n = rng.randint(3, 300)
        start = rng.choice(shared) if i % 2 else rng.randint(0, len(ids) - n)
        request = {"input_ids": ids[start: start + n], "max_new_tokens": rng.randint(1, 40),
                   "kvzap": rng.choice(["decoding", "decoding", "prefill", "off"])}
        if i % 5 == 0:
            request["abort_after"] = rng.uniform(0.05, 1.5)
        stream.append(request)
    spec = {"model": str(model), "bundle": str(bundle), "mode": "ragged", "stream": stream,
            "engine": {"max_total_tokens": 1500, "max_running_requests": 12, "tp_size": 2}}
    done = run_driver(tmp_path, spec)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    finishes = [r["finish"] for r in out["stream"]]
    assert len(finishes) == 200 and finishes.count("length") >= 100 and finishes.count("abort") >= 5, finishes
    ranks = _by_rank(out["readings"])
    assert sorted(ranks) == [0, 1]
    steps = {k: [r for r in lines if r.get("event") != "idle"] for k, lines in ranks.items()}
    pool = steps[0][0]["head_slots_pool"]
    assert steps[1][0]["head_slots_pool"] == pool  # one KV head a rank: the same pool size
    # one figure of room on both ranks at every step (a step's line per request, matched across ranks)
    seen = {}
    for r in steps[0]:
        seen[(r["rid"], r["forward"], r["output_tokens"], r["seq_len"], r["step_tokens"])] = r
    matched = 0
    for r in steps[1]:
        other = seen.get((r["rid"], r["forward"], r["output_tokens"], r["seq_len"], r["step_tokens"]))
        if other is not None:
            matched += 1
            assert other["available_to_scheduler"] == r["available_to_scheduler"], (other, r)
    assert matched > 0.9 * len(steps[1])
    per_token = steps[1][0]["layers"] * steps[1][0]["kv_heads"]
    # never more room than rank 1 (the fuller) has: its free and cached entries, in tokens
    for r in steps[1]:
        assert r["available_to_scheduler"] <= (r["head_slots_free"] + r["head_slots_cached"]) // per_token, r
    held = {k: max(r["head_slots_held"] for r in lines) for k, lines in steps.items()}
    assert held[1] > 0.6 * pool and held[0] < 0.6 * held[1], held  # rank 1 filled its pool, rank 0 far less
    assert max(r["running_requests"] for r in steps[1]) > 1
    for k, lines in ranks.items():
        idle = [r for r in lines if r.get("event") == "idle"]
        assert idle and idle[-1]["t"] > max(r["t"] for r in steps[k]), k
        last = idle[-1]
        assert last["head_slots_held"] == 0 and last["rows"] == 0, (k, last)
        assert last["head_slots_free"] + last["head_slots_cached"] == last["head_slots_pool"], (k, last)


def test_two_data_parallel_replicas_both_serve_and_free_memory_with_kvpress_tokens(qwen3, tmp_path):
    """``--dp-size 2`` in ragged mode: the reference prompts, four copies each and both kvpress settings, at once.
    Every output equals kvpress's tokens, both replicas' readings show requests whose pools hold fewer entries than
    dense storage would, and SGLang's internal state (what ``/server_info`` lists per replica) carries each replica's
    KVzap figures."""
    model, bundle = qwen3
    stream, expected = reference_stream(bundle)
    spec = {"model": str(model), "bundle": str(bundle), "mode": "ragged", "stream": stream, "server_info": True,
            "engine": {"dp_size": 2, "max_total_tokens": 8192, "max_running_requests": 8}}
    done = run_driver(tmp_path, spec)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert [r["output_ids"] for r in out["stream"]] == expected
    replicas = defaultdict(list)
    for r in out["readings"]:
        if r.get("event") != "idle":
            replicas[r["dp_rank"]].append(r)
    assert sorted(replicas) == [0, 1], sorted(replicas)
    for lines in replicas.values():
        decided = [r for r in lines if r["kvzap"] and r["forward"] == "decode"]
        assert decided and any(r["row_head_slots"] < (r["prompt_tokens"] + r["output_tokens"]) * r["layers"] * r["kv_heads"]
                               for r in decided)
    states = out["server_info"]["internal_states"]
    assert sorted(s["kvzap"]["dp_rank"] for s in states) == [0, 1], states
    assert all(s["kvzap"]["mode"] == "ragged" and s["kvzap"]["head_slots_pool"] > 0 for s in states)


def test_tensor_parallelism_that_would_replicate_kv_heads_stops_ragged_mode_in_one_line(qwen3, tmp_path):
    """Ragged mode at more ranks than KV heads (SGLang would replicate heads over ranks) is refused at launch."""
    model, bundle = qwen3
    spec = {"model": str(model), "bundle": str(bundle), "mode": "ragged", "prompts": [{"input_ids": [1, 2, 3]}],
            "runs": ["decoding"], "max_new_tokens": 2, "engine": {"tp_size": 4}}
    done = run_driver(tmp_path, spec, SGLANG_CPU_OMP_THREADS_BIND="0|1|0|1")
    assert done.returncode != 0
    assert "tensor parallelism is 4 for 2 KV heads" in done.stderr and "--tp-size 2" in done.stderr, done.stderr[-2000:]


def test_a_request_that_fits_only_in_what_finished_requests_freed_is_admitted_once_they_end(qwen3, tmp_path):
    """``--tp-size 2``, ragged mode, a pool of 600 tokens and three requests of 280 submitted at once: two run, the third
    fits only in what they free when they end. Their frees come after the last step end's agreement, and a loop that
    runs no batch has no step end: the ranks agree at such loops too (the BEFORE hook on ``on_idle``), so the third is
    admitted and every request ends (without that agreement it would wait for ever: the driver's timeout)."""
    model, bundle = qwen3
    ids = [i for p in reference_prompts(bundle) for i in p]
    stream = [{"input_ids": ids[k * 250:(k + 1) * 250], "max_new_tokens": 30, "kvzap": "off"} for k in range(3)]
    spec = {"model": str(model), "bundle": str(bundle), "mode": "ragged", "stream": stream,
            "engine": {"max_total_tokens": 600, "max_running_requests": 4, "tp_size": 2, "disable_radix_cache": True}}
    done = run_driver(tmp_path, spec, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert [r["finish"] for r in out["stream"]] == ["length"] * 3
    running = [r["running_requests"] for r in out["readings"] if r.get("event") != "idle" and r["tp_rank"] == 0]
    assert max(running) == 2  # the third waited for the room the first two held
