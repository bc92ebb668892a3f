"""Figures of one SGLang stream run, read from the scheduler's own step-end readings (``KVZAP_STATS``), and
their medians over interleaved rounds.

A run submits every request at once (``integrations/sglang/driver.py``, stream mode) and records, per request,
its submission and completion times on the wall clock; the scheduler writes one reading per request at each
step end (``integrations/sglang/stats.py``: SGLang's allocator, the per-head pool's free list in ragged mode,
what KVzap's decisions left). From them:

- throughput: output tokens / wall clock of the whole stream, requests / wall clock;
- latency: time to first token (the step end of a request's prompt, its last chunk - its submission),
  inter-token latency (the time between a request's consecutive step ends from there on), p50 / p90 over requests
  and tokens;
- concurrency: the most requests in one decode step (``max_running``);
- memory, over every tensor-parallel rank (each holds its own KV heads; summed step by step, the ranks running the
  same steps; where their readings do not show the same step ends, each rank's own busiest step, an upper bound): K/V
  entries (one token of one KV head of one layer) a request holds at the step end that ended its
  prompt (its last extend step before its first decode step: where KVzap decided the prompt; mean), the pool's entries
  held for running requests at the busiest step (with SGLang's radix cache on, less what its tree keeps of ended
  requests; a shared prefix counts once here, in every request that holds it in the per-request figures), and
  ``freed_at_peak``: over the requests, the entries
  freed at each request's last step (its largest footprint) relative to what dense storage holds then,
  ``(prompt + tokens sampled before that step) * layers * kv_heads``; bytes of every buffer the mode allocated (SGLang's K/V, our
  pool, its row tables, score buffers, the logical slot list) at the busiest step;
- step times: the wall time between consecutive step ends (the first step: from the first submission), per
  decode batch size (median), and for prompts the extend steps' total time per 1,000 prompt tokens computed (a
  reading's ``step_tokens``: a chunk counts once, a prefix taken from the radix cache not at all; and per step, with
  its prompt count);
- radix cache: the prompt tokens SGLang took from its cache over all prompt tokens of the finished requests (its
  ``meta_info["cached_tokens"]``; 0 with the cache off);
- ragged mode's engine counters: the decode steps whose forward replayed a CUDA graph (``decode_graph_replays``, the
  readings' cumulative count at its largest: 0 where graphs did not run, e.g. on a CPU) and the τ in effect at the
  last reading that gives one (``threshold_in_effect``: the bundle's, or the one ``KVZAP_PRUNED_FRACTION`` set); None
  where the readings carry neither (dense, evict).
"""

from __future__ import annotations

import statistics
from collections import defaultdict


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    at = (len(ordered) - 1) * q
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def _held(line: dict) -> int:
    """K/V entries one reading says its request holds (the per-head pool's rows in ragged mode)."""
    if "row_head_slots" in line:
        return int(line["row_head_slots"])
    return int(line["row_slots"]) * line["layers"] * line["kv_heads"]


def _pool_held(line: dict, per_token: int) -> int:
    """K/V entries the pool holds for running requests at one reading: the per-head pool's (ragged mode), else SGLang's
    slots less those its radix tree keeps only as a cache (evictable, counted as room by its admission)."""
    if "head_slots_held" in line:
        return int(line["head_slots_held"])
    return (int(line["slots_held"]) - int(line.get("tree_evictable_slots", 0))) * per_token


def _prompt_end(lines: list[dict]) -> dict:
    """A request's reading at the end of its prompt: its last extend step before its first decode step (a prompt
    prefilled in chunks is decided at its last chunk; a retracted request's later re-prefill does not count)."""
    end = lines[0]
    for line in lines:
        if line["forward"] != "extend":
            break
        end = line
    return end


def _logical(line: dict) -> int:
    return line.get("logical_length", line.get("seq_len", line["prompt_tokens"] + line["output_tokens"]))


def _steps(readings: list[dict]) -> list[list[dict]]:
    """The step ends of one rank's readings, in order, each its lines."""
    by_time: dict[float, list[dict]] = defaultdict(list)
    for line in readings:
        if line.get("event") != "idle":
            by_time[line["t"]].append(line)
    return [by_time[t] for t in sorted(by_time)]


def _by_rid(steps: list[list[dict]]) -> dict[str, list[dict]]:
    """Each request's lines, in step order."""
    by_rid: dict[str, list[dict]] = defaultdict(list)
    for lines in steps:
        for line in lines:
            by_rid[line["rid"]].append(line)
    return by_rid


def _memory(steps: list[list[dict]]) -> dict:
    """One rank's memory figures (module docstring) from its step ends: the entries each request held at the end of
    its prompt and at its last step, and what a dense cache holds then; the pool's size; per step, the entries held
    for running requests and every buffer's bytes."""
    per_token = steps[0][0]["layers"] * steps[0][0]["kv_heads"]
    by_rid = _by_rid(steps)
    last = [lines[-1] for lines in by_rid.values()]
    # At a step end a dense cache holds the request's logical length in that forward: its prompt and every token sampled
    # before this step, the last one this step's input (stats.py: KVzap's ``logical_length`` where it decided for the
    # request, else SGLang's ``seq_len``; readings from before those were written: the counts, which under the overlap
    # scheduler may lack the previous step's token).
    return {"after_prefill": {rid: _held(_prompt_end(lines)) for rid, lines in by_rid.items()},
            "held_last": sum(_held(line) for line in last), "dense_last": sum(_logical(line) * per_token for line in last),
            "pool": steps[0][0].get("head_slots_pool", steps[0][0]["pool_slots"] * per_token),
            "per_step": [(_pool_held(lines[0], per_token), lines[0].get("bytes", {})) for lines in steps]}


def _ranks_memory(readings: list[dict]) -> dict:
    """The memory figures summed over the tensor-parallel ranks whose readings ``readings`` holds (step by step: every
    rank runs the same steps), with the busiest step's."""
    ranks = sorted({r.get("tp_rank", 0) for r in readings})
    each = [_memory(_steps([r for r in readings if r.get("tp_rank", 0) == rank])) for rank in ranks]
    if len({len(m["per_step"]) for m in each}) > 1:  # not the same step ends: each rank's own busiest (an upper bound)
        steps = [[max(m["per_step"], key=lambda step: step[0])] for m in each]
    else:
        steps = [m["per_step"] for m in each]
    per_step = [(sum(held for held, _ in step), {k: sum(b.get(k, 0) for _, b in step) for k in step[0][1]})
                for step in zip(*steps)]
    peak, busiest = max(per_step, key=lambda step: step[0])
    rids = each[0]["after_prefill"]
    return {"after_prefill": statistics.mean(sum(m["after_prefill"].get(rid, 0) for m in each) for rid in rids),
            "freed": 1.0 - sum(m["held_last"] for m in each) / sum(m["dense_last"] for m in each),
            "pool": sum(m["pool"] for m in each), "peak": peak, "bytes": busiest}


def run_figures(result: dict) -> dict:
    """The figures of one run (see the module docstring) from the driver's stream result."""
    # Under tensor parallelism every rank writes its own lines (its own KV heads): the steps are timed from
    # tensor-parallel rank 0's (every rank runs them), the memory figures summed over the ranks.
    readings = [r for r in result["readings"] if r.get("tp_rank", 0) == 0]
    if len({r.get("dp_rank") for r in result["readings"]}) > 1:
        raise ValueError("the readings come from several data-parallel replicas: the figures time one scheduler's steps "
                         "(run the benchmark without dp_size)")
    steps = _steps(readings)
    if not steps:
        raise ValueError("the run left no step readings (KVZAP_STATS): was the plugin loaded by the engine?")
    by_rid = _by_rid(steps)
    times = [lines[0]["t"] for lines in steps]
    stream = result["stream"]
    finished = [r for r in stream if r.get("finish") != "abort"]
    out_tokens = sum(len(r["output_ids"]) for r in stream)
    wall = result["wall_seconds"]
    submitted = {r["rid"]: r["t_submit"] for r in stream if "t_submit" in r}
    # A prompt's first token comes at the step end of its last chunk (earlier chunks sample nothing); the tokens after
    # it are one per step end.
    ttft = [_prompt_end(by_rid[rid])["t"] - t0 for rid, t0 in submitted.items() if by_rid.get(rid)]
    sampled = {rid: lines[lines.index(_prompt_end(lines)):] for rid, lines in by_rid.items()}
    itl = [b["t"] - a["t"] for lines in sampled.values() for a, b in zip(lines, lines[1:])]
    decode_sizes = [len(lines) for lines in steps if lines[0]["forward"] == "decode"]
    decode_steps: dict[int, list[float]] = defaultdict(list)
    extend_s, extend_tokens, extend_steps = 0.0, 0, []
    # The first step is timed from the first submission (nothing ran before it).
    starts = [min(submitted.values())] if submitted else []
    for a, lines in zip(starts + times, steps if starts else steps[1:]):
        b = lines[0]["t"]
        if lines[0]["forward"] == "decode":
            decode_steps[len(lines)].append(b - a)
        else:
            prompts = sum(line.get("step_tokens", line["prompt_tokens"]) for line in lines)
            extend_s += b - a
            extend_tokens += prompts
            extend_steps.append({"prompts": len(lines), "prompt_tokens": prompts, "seconds": b - a})
    memory = _ranks_memory(result["readings"])
    replays = [int(r["decode_graph_replays"]) for r in readings if r.get("decode_graph_replays") is not None]
    taus = [float(r["threshold"]) for r in readings if r.get("threshold") is not None]
    cached = [r["cached_tokens"] for r in finished if r.get("cached_tokens") is not None]
    prompt_tokens = sum(r["prompt_tokens"] for r in finished if r.get("cached_tokens") is not None)
    return {
        "requests": len(stream), "finished": len(finished), "output_tokens": out_tokens, "wall_s": wall,
        "tokens_per_s": out_tokens / wall, "requests_per_s": len(finished) / wall,
        "ttft_p50_s": _percentile(ttft, 0.5), "ttft_p90_s": _percentile(ttft, 0.9),
        "itl_p50_s": _percentile(itl, 0.5), "itl_p90_s": _percentile(itl, 0.9),
        "max_running": max(decode_sizes, default=0),
        "kv_held_after_prefill": memory["after_prefill"], "kv_pool_entries": memory["pool"],
        "kv_peak_entries": memory["peak"], "freed_at_peak": memory["freed"], "bytes": memory["bytes"],
        "decode_step_s": {str(n): statistics.median(v) for n, v in sorted(decode_steps.items())},
        "decode_steps": {str(n): len(v) for n, v in sorted(decode_steps.items())},
        "prefill_s_per_1k_tokens": 1000 * extend_s / extend_tokens if extend_tokens else None,
        "prefill_s": extend_s, "extend_steps": extend_steps, "launch_s": result["engine"]["launch_seconds"],
        "radix_hit_rate": sum(cached) / prompt_tokens if prompt_tokens else None,
        "decode_graph_replays": max(replays) if replays else None, "threshold_in_effect": taus[-1] if taus else None,
    }


SCALARS = ("tokens_per_s", "requests_per_s", "wall_s", "ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p90_s",
           "max_running", "kv_held_after_prefill", "kv_peak_entries", "freed_at_peak", "prefill_s_per_1k_tokens",
           "prefill_s", "radix_hit_rate", "decode_graph_replays", "threshold_in_effect")


def spread(values: list[float]) -> dict:
    """Median, min and max of the rounds' values (None where a round has none)."""
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(runs: list[dict]) -> dict:
    """Per configuration (``label``): each scalar figure as median / min / max over the rounds, the decode step
    per batch size (median over rounds of each round's median), the bytes of the busiest step (largest)."""
    by_label: dict[str, list[dict]] = defaultdict(list)
    for run in runs:
        by_label[run["label"]].append(run)
    out = {}
    for label, group in by_label.items():
        entry = {name: spread([r["figures"].get(name) for r in group]) for name in SCALARS}
        sizes = sorted({n for r in group for n in r["figures"]["decode_step_s"]}, key=int)
        entry["decode_step_s"] = {n: spread([r["figures"]["decode_step_s"].get(n) for r in group]) for n in sizes}
        keys = sorted({k for r in group for k in r["figures"]["bytes"]})
        entry["bytes"] = {k: max(r["figures"]["bytes"].get(k, 0) for r in group) for k in keys}
        entry["mode"], entry["threshold"] = group[0]["mode"], group[0]["threshold"]
        entry["pruned_fraction"] = group[0].get("pruned_fraction")
        out[label] = entry
    return out


def compare(summary: dict, runs: list[dict], baseline: str = "dense") -> dict:
    """Each configuration against the baseline, on medians: throughput ratio, running ratio next to what the
    freed memory predicts (``1 / (1 - freed_at_peak)``), decode step ratio at each batch size both reached,
    prefill time ratio (per 1,000 prompt tokens computed: a prefix taken from the radix cache is not in it; the
    total prefill time, ``prefill_s``, is in the summary)."""
    base = summary[baseline]
    out = {}
    for label, entry in summary.items():
        if label == baseline:
            continue
        med = lambda name, e=entry: e[name]["median"]  # noqa: E731
        freed = med("freed_at_peak")
        common = [n for n in entry["decode_step_s"] if n in base["decode_step_s"]]
        out[label] = {
            "tokens_per_s_ratio": med("tokens_per_s") / base["tokens_per_s"]["median"],
            "tokens_per_s_ratio_per_round": _per_round(runs, label, baseline, "tokens_per_s"),
            "running_ratio": med("max_running") / base["max_running"]["median"],
            "running_ratio_predicted": 1.0 / (1.0 - freed) if freed is not None and freed < 1 else None,
            "decode_step_ratio_at_equal_batch": {n: entry["decode_step_s"][n]["median"] / base["decode_step_s"][n]["median"]
                                                 for n in common},
            "prefill_ratio": (med("prefill_s_per_1k_tokens") / base["prefill_s_per_1k_tokens"]["median"]
                              if med("prefill_s_per_1k_tokens") and base["prefill_s_per_1k_tokens"]["median"] else None),
        }
        predicted = out[label]["running_ratio_predicted"]
        out[label]["running_vs_predicted"] = out[label]["running_ratio"] / predicted if predicted else None
    return out


def _per_round(runs: list[dict], label: str, baseline: str, name: str) -> list[float]:
    """The ratio within each round (the two runs of one round ran minutes apart on the same machine)."""
    rounds = sorted({r["round"] for r in runs})
    ratios = []
    for number in rounds:
        mine = [r for r in runs if r["round"] == number and r["label"] == label]
        base = [r for r in runs if r["round"] == number and r["label"] == baseline]
        if mine and base:
            ratios.append(mine[0]["figures"][name] / base[0]["figures"][name])
    return ratios
