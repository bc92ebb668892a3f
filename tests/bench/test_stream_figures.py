"""The SGLang stream benchmark's figures from readings written by hand: each figure checked against the value
worked out here from the same timeline (no engine)."""

from __future__ import annotations

import pytest

from kvzap_export.bench.stream_figures import compare, run_figures, summarize

LH = 6  # layers x KV heads of the readings below


def reading(t, rid, forward, running, prompt, output, held=None, pool_held=0, slots=0):
    line = {"t": t, "rid": rid, "forward": forward, "running_requests": running, "prompt_tokens": prompt,
            "output_tokens": output, "row_slots": prompt + output, "slots_held": slots, "pool_slots": 100, "layers": 2,
            "kv_heads": 3, "bytes": {"sglang_kv": 1000}}
    if held is not None:  # ragged mode: the per-head pool's rows and free list
        line.update(row_head_slots=held, head_slots_held=pool_held, head_slots_pool=600)
    return line


def result(ragged: bool, speed: float = 1.0) -> dict:
    """Two requests of 10-token prompts: a prefill of both at t=1, three decode steps, r1 stops after two."""
    h = (lambda n: n) if ragged else (lambda n: None)
    s = lambda t: 100 + t / speed  # noqa: E731
    readings = [
        reading(s(1), "r0", "extend", 2, 10, 0, h(30), 54), reading(s(1), "r1", "extend", 2, 10, 0, h(24), 54),
        reading(s(2), "r0", "decode", 2, 10, 1, h(36), 66), reading(s(2), "r1", "decode", 2, 10, 1, h(30), 66),
        reading(s(4), "r0", "decode", 2, 10, 2, h(42), 78), reading(s(4), "r1", "decode", 2, 10, 2, h(36), 78),
        reading(s(5), "r0", "decode", 1, 10, 3, h(48), 48),
        {"event": "idle", "t": s(6)},
    ]
    stream = [{"rid": "r0", "output_ids": [1] * 4, "finish": "length", "t_submit": 100.0},
              {"rid": "r1", "output_ids": [1] * 3, "finish": "length", "t_submit": 100.5}]
    return {"readings": readings, "stream": stream, "wall_seconds": 5.0 / speed, "engine": {"launch_seconds": 9.0}}


def test_figures_of_one_run_from_its_readings():
    f = run_figures(result(ragged=True))
    assert f["tokens_per_s"] == pytest.approx(7 / 5) and f["requests_per_s"] == pytest.approx(2 / 5)
    assert f["ttft_p50_s"] == pytest.approx(0.75) and f["ttft_p90_s"] == pytest.approx(0.95)  # 1.0 and 0.5
    # r0: 1, 2, 1; r1: 1, 2 -> sorted 1, 1, 1, 2, 2
    assert f["itl_p50_s"] == pytest.approx(1.0) and f["itl_p90_s"] == pytest.approx(2.0)
    assert f["max_running"] == 2 and f["decode_step_s"] == {"1": pytest.approx(1.0), "2": pytest.approx(1.5)}
    assert f["kv_held_after_prefill"] == 27 and f["kv_peak_entries"] == 78 and f["kv_pool_entries"] == 600
    # each request's last reading: r0 holds 48 of (10 + 3) * 6, r1 36 of (10 + 2) * 6
    assert f["freed_at_peak"] == pytest.approx(1 - (48 + 36) / (13 * LH + 12 * LH))
    assert f["prefill_s_per_1k_tokens"] == pytest.approx(1000 * 1.0 / 20)  # timed from the first submission
    assert f["extend_steps"] == [{"prompts": 2, "prompt_tokens": 20, "seconds": pytest.approx(1.0)}]
    dense = run_figures(result(ragged=False))
    assert dense["freed_at_peak"] == pytest.approx(0.0) and dense["kv_held_after_prefill"] == 10 * LH


def test_the_dense_size_comes_from_sglangs_length_where_a_reading_has_it():
    """Under SGLang's overlap scheduler a reading's ``output_tokens`` lacks the previous step's token (the step end runs
    before SGLang processes that step's result); ``seq_len``, SGLang's length in the forward, and KVzap's
    ``logical_length`` do not (evict mode lowers ``seq_len``: the logical length wins): with them the figures equal
    those of the same timeline without overlap, without them the dense size would be short."""
    plain = run_figures(result(ragged=True))
    lagging = result(ragged=True)
    for line in lagging["readings"]:
        if line.get("forward") == "decode":
            line["seq_len"] = line["prompt_tokens"] + line["output_tokens"]
            line["output_tokens"] -= 1
    assert run_figures(lagging)["freed_at_peak"] == pytest.approx(plain["freed_at_peak"])
    for line in lagging["readings"]:  # evict mode: SGLang's length is what it kept, KVzap's logical length is the one
        if "seq_len" in line:
            line["logical_length"], line["seq_len"] = line["seq_len"], line["seq_len"] - 5
    assert run_figures(lagging)["freed_at_peak"] == pytest.approx(plain["freed_at_peak"])
    for line in lagging["readings"]:
        line.pop("seq_len", None), line.pop("logical_length", None)
    assert run_figures(lagging)["freed_at_peak"] < plain["freed_at_peak"]


def test_medians_over_rounds_and_ratios_against_dense():
    runs = []
    for number, speed in enumerate((1.0, 0.5, 2.0), start=1):
        runs.append({"round": number, "label": "dense", "mode": "dense", "threshold": None,
                     "figures": run_figures(result(False, speed))})
        runs.append({"round": number, "label": "ragged", "mode": "ragged", "threshold": None,
                     "figures": run_figures(result(True, 2 * speed))})
    summary = summarize(runs)
    tokens = summary["ragged"]["tokens_per_s"]
    assert tokens["median"] == pytest.approx(2 * 7 / 5) and tokens["min"] == pytest.approx(7 / 5)
    assert tokens["max"] == pytest.approx(4 * 7 / 5) and tokens["n"] == 3
    versus = compare(summary, runs)["ragged"]
    assert versus["tokens_per_s_ratio"] == pytest.approx(2.0)
    assert versus["tokens_per_s_ratio_per_round"] == pytest.approx([2.0, 2.0, 2.0])
    assert versus["decode_step_ratio_at_equal_batch"] == {"1": pytest.approx(0.5), "2": pytest.approx(0.5)}
    assert versus["prefill_ratio"] == pytest.approx(0.5)
    freed = summary["ragged"]["freed_at_peak"]["median"]
    assert versus["running_ratio"] == 1.0 and versus["running_ratio_predicted"] == pytest.approx(1 / (1 - freed))


def test_a_prompt_in_chunks_counts_what_its_last_chunk_left():
    """KVzap decides a prompt at its last chunk: the first chunk's step end (dense) is not 'after the prompt'."""
    lines = [reading(101, "r0", "extend", 1, 10, 0, 60, 60), reading(102, "r0", "extend", 1, 10, 0, 33, 33),
             reading(103, "r0", "decode", 1, 10, 1, 39, 39)]
    run = {"readings": lines, "stream": [{"rid": "r0", "output_ids": [1, 1], "finish": "length", "t_submit": 100.0}],
           "wall_seconds": 3.0, "engine": {"launch_seconds": 1.0}}
    assert run_figures(run)["kv_held_after_prefill"] == 33


def report_script():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("report", Path(__file__).parents[2] / "scripts" / "sglang_stream_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_report_script_shows_every_run_and_ratio():
    """scripts/sglang_stream_report.py renders a bench document: each run's figures and the ratios appear."""
    module = report_script()
    runs = [{"round": n, "label": label, "mode": label, "threshold": None, "attention_backend": "torch_native",
             "figures": run_figures(result(label == "ragged", speed))}
            for n, speed in ((1, 1.0), (2, 2.0)) for label in ("dense", "ragged")]
    summary = summarize(runs)
    doc = {"machine": "test machine", "date": "2026-11-25", "runs": runs, "summary": summary, "vs_dense": compare(summary, runs),
           "dense_backend": {"candidates": {"torch_native": {"tokens_per_s": 2.0, "wall_s": 1.0},
                                            "flex_attention": {"error": "no"}}, "chosen": "torch_native",
                             "probe": {"requests": 8, "new_tokens": 32}},
           "settings": {"requests": 2, "prompt_tokens": 10, "new_tokens": 4, "pool_tokens": 100, "rounds": 2,
                        "engine_args": {}, "prompts_sha256": "ab" * 32, "prompt_source": "test",
                        "surrogate": {"variant": "mlp", "sha256": "cd" * 32}, "pruning": {"threshold": -4}}}
    text = module.report(doc)
    assert "torch_native: 2.00 tokens/s" in text and "flex_attention: failed (no)" in text
    assert text.count("| 1 | dense |") == 1 and text.count("| 2 | ragged |") == 1
    assert "| output tokens/s (ratio of medians) | 1.00 |" in text  # ragged at the same speed as dense here
    assert "round 2, ragged: decode 1: 1 × 0.500, 2: 2 × 0.750; prefill 2 × 0.50" in text
    assert "Against dense:" in text and "| 1 | dense | torch_native | off | off |" in text  # a document before --configs
    doc["settings"].update(baseline="dense, radix", shared_prefix_tokens=6)
    runs[0]["radix_cache"] = True
    text = module.report(doc)
    assert "Against dense, radix:" in text and "(the first 6 shared by all)" in text
    assert "| 1 | dense | torch_native | on | off |" in text
    assert "KVzap's configurations" not in text  # a document before --kvzap-overlap
    doc["settings"]["kvzap_overlap"] = False
    assert "KVzap's configurations: SGLang's overlap scheduler off (`--kvzap-overlap`)." in module.report(doc)


@pytest.mark.parametrize("content, says", [(None, "cannot read"), ("{", "is not JSON"),
                                           ('{"runs": []}', "lacks settings, summary, vs_dense")])
def test_the_report_script_refuses_what_is_not_a_bench_document(tmp_path, capsys, content, says):
    """A missing file, broken JSON or another JSON document: exit 2, one line naming the file, nothing on stdout."""
    path = tmp_path / "bench.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as stop:
        report_script().main([str(path)])
    captured = capsys.readouterr()
    assert stop.value.code == 2 and captured.out == ""
    assert says in captured.err and str(path) in captured.err and len(captured.err.strip().splitlines()) == 1


def test_prefill_counts_the_tokens_each_step_computed_and_the_radix_hit_rate():
    """A prompt in two chunks counts its tokens once; a prefix SGLang took from its radix cache is not prefill work;
    the hit rate is the cached prompt tokens over all prompt tokens (SGLang's meta_info)."""
    lines = [dict(reading(101, "r0", "extend", 1, 10, 0), step_tokens=6),
             dict(reading(102, "r0", "extend", 2, 10, 0), step_tokens=4), dict(reading(102, "r1", "extend", 2, 10, 0), step_tokens=2),
             reading(104, "r0", "decode", 2, 10, 1), reading(104, "r1", "decode", 2, 10, 1)]
    stream = [{"rid": "r0", "output_ids": [1, 1], "finish": "length", "t_submit": 100.0, "prompt_tokens": 10,
               "cached_tokens": 0},
              {"rid": "r1", "output_ids": [1, 1], "finish": "length", "t_submit": 100.0, "prompt_tokens": 10,
               "cached_tokens": 8}]
    f = run_figures({"readings": lines, "stream": stream, "wall_seconds": 4.0, "engine": {"launch_seconds": 1.0}})
    assert f["extend_steps"] == [{"prompts": 1, "prompt_tokens": 6, "seconds": pytest.approx(1.0)},
                                 {"prompts": 2, "prompt_tokens": 6, "seconds": pytest.approx(1.0)}]
    assert f["prefill_s_per_1k_tokens"] == pytest.approx(1000 * 2.0 / 12)
    assert f["radix_hit_rate"] == pytest.approx(8 / 20)
    # r0's first token comes with its last chunk (t=102), not its first; the chunks' gap is no inter-token latency
    assert f["ttft_p50_s"] == pytest.approx(2.0) and f["itl_p50_s"] == pytest.approx(2.0) == f["itl_p90_s"]
    # with the radix cache on, slots its tree keeps as a cache of ended requests are not held for running ones
    for line in lines:
        line.update(slots_held=30, tree_evictable_slots=12)
    f = run_figures({"readings": lines, "stream": stream, "wall_seconds": 4.0, "engine": {"launch_seconds": 1.0}})
    assert f["kv_peak_entries"] == (30 - 12) * LH
    assert run_figures(result(ragged=False))["radix_hit_rate"] is None  # a stream without SGLang's counts


def test_ragged_readings_give_the_replay_count_and_the_tau_in_effect():
    """The cumulative count of decode steps that replayed a CUDA graph (its largest reading, idle lines too) and the last
    τ a reading gives; readings without them (dense) give None, and the medians carry them."""
    run = result(ragged=True)
    for i, line in enumerate(run["readings"]):
        line.update(decode_graph_replays=max(0, i - 2), threshold=-1.25 if i < 4 else -0.5)
    f = run_figures(run)
    assert f["decode_graph_replays"] == 5 and f["threshold_in_effect"] == -0.5
    dense = run_figures(result(ragged=False))
    assert dense["decode_graph_replays"] is None and dense["threshold_in_effect"] is None
    entry = summarize([{"round": 1, "label": "ragged", "mode": "ragged", "threshold": None, "pruned_fraction": 0.7,
                        "figures": f}])["ragged"]
    assert entry["decode_graph_replays"]["median"] == 5 and entry["pruned_fraction"] == 0.7


def test_under_tensor_parallelism_steps_are_rank_zeros_and_memory_is_every_ranks():
    """Every rank writes its own lines (its own KV heads): the steps are timed from tensor-parallel rank 0's, the
    memory figures summed over the ranks step by step (rank 1 here: the same requests, 1 entry held in its pool at
    every step, its own pool and buffers)."""
    one = result(ragged=True)
    two = result(ragged=True)
    two["readings"] = [{**r, "tp_rank": 0} for r in one["readings"]] + [
        {**r, "tp_rank": 1, "t": r["t"] + 0.01, **({"head_slots_held": 1} if "head_slots_held" in r else {})}
        for r in one["readings"]]
    alone, both = run_figures(one), run_figures(two)
    memory = {"kv_held_after_prefill": 2 * 27, "kv_pool_entries": 2 * 600, "kv_peak_entries": 78 + 1,
              "bytes": {"sglang_kv": 2 * 1000}, "freed_at_peak": alone["freed_at_peak"]}
    assert both == {**alone, **memory}
    lopsided = result(ragged=True)
    lopsided["readings"] = [{**r, "tp_rank": 0} for r in one["readings"]] + [
        {**r, "tp_rank": 1, "row_head_slots": 0} for r in one["readings"] if "rid" in r]
    # r0 holds 48 + 0 of (13 + 13) * 6 at its last step, r1 36 + 0 of (12 + 12) * 6
    assert run_figures(lopsided)["freed_at_peak"] == pytest.approx(1 - (48 + 36) / (26 * LH + 24 * LH))
    uneven = result(ragged=True)
    uneven["readings"] = two["readings"][:-2]  # rank 1 lacks its last step end: each rank's own busiest step
    assert run_figures(uneven)["kv_peak_entries"] == 78 + 1