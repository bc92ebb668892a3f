"""SGLang at a fixed KV budget: dense vs KVzap's evict mode vs its ragged (per-head) mode, one run.

Each mode launches a real ``sglang.Engine`` (the engine environment's Python; ``integrations/sglang/driver``)
with the same KV budget (``--max-total-tokens``) and submits the same stream of requests at once (distinct
prompts of ``prompt_tokens`` tokens, ``new_tokens`` greedy tokens each). Every figure comes from the
scheduler's own step-end readings (``KVZAP_STATS``): how many requests SGLang ran at once, the KV held
(SGLang's allocator; in ragged mode the per-head pool's free list), and the step times. Dense is SGLang
without KVzap (readings only).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

MODES = ("dense", "evict", "ragged")


def stream_prompts(tokenizer, count: int, tokens: int) -> list[list[int]]:
    """``count`` distinct prompts of ``tokens`` tokens from Python's own documentation (pydoc topics)."""
    from pydoc_data.topics import topics

    ids = tokenizer("\n\n".join(topics[k] for k in sorted(topics)))["input_ids"]
    if len(ids) < count * tokens:
        raise ValueError(f"not enough text for {count} prompts of {tokens} tokens")
    step = len(ids) // count
    return [ids[i * step: i * step + tokens] for i in range(count)]


def summarize_mode(result: dict) -> dict:
    """Figures of one mode from the driver's stream result (readings of the scheduler process)."""
    steps = [r for r in result["readings"] if r.get("event") != "idle"]
    by_time: dict[float, list[dict]] = {}
    for line in steps:
        by_time.setdefault(line["t"], []).append(line)
    times = sorted(by_time)
    # The most requests running at once: the largest decode batch (every running request decodes each step).
    most = max((len(by_time[t]) for t in times if by_time[t][0]["forward"] == "decode"), default=0)
    # A decode step's time: from the previous step end to its own; at saturation, ``most`` requests ran in it.
    intervals = [b - a for a, b in zip(times, times[1:])
                 if by_time[b][0]["forward"] == "decode" and by_time[a][0]["forward"] == "decode" and len(by_time[b]) == most]
    first = {}
    for line in steps:  # the request's first step end: its prompt's KV, after KVzap's prefill decision
        first.setdefault(line["rid"], line)
    layers, heads = steps[0]["layers"], steps[0]["kv_heads"]
    if "row_head_slots" in steps[0]:
        held = [line["row_head_slots"] for line in first.values()]
        pool_peak = max(line["head_slots_held"] for line in steps)
        pool = steps[0]["head_slots_pool"]
    else:
        held = [line["row_slots"] * layers * heads for line in first.values()]
        pool_peak = max(line["slots_held"] for line in steps) * layers * heads
        pool = steps[0]["pool_slots"] * layers * heads
    out_tokens = sum(len(r["output_ids"]) for r in result["stream"])
    step_s = statistics.median(intervals) if intervals else None
    return {"requests": len(result["stream"]), "max_running": most, "kv_held_after_prefill": statistics.mean(held),
            "kv_pool_entries": pool, "kv_peak_entries": pool_peak,
            "decode_step_s_at_saturation": step_s, "tokens_per_s_at_saturation": most / step_s if step_s else None,
            "time_per_output_token_s": step_s, "wall_s": result["wall_seconds"],
            "tokens_per_s_overall": out_tokens / result["wall_seconds"], "launch_s": result["engine"]["launch_seconds"]}


def bench_sglang(bundle: str, model: str, python: str, requests: int = 24, prompt_tokens: int = 1024, new_tokens: int = 32,
                 pool_tokens: int | None = None, modes: tuple[str, ...] = MODES, on_mode=None) -> list[dict]:
    """One row per mode (see the module docstring); ``pool_tokens`` defaults to 8 requests' worth."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = stream_prompts(tokenizer, requests, prompt_tokens)
    pool_tokens = pool_tokens or 8 * (prompt_tokens + new_tokens)
    rows = []
    for mode in modes:
        spec = {"model": str(Path(model).absolute()), "bundle": str(Path(bundle).absolute()), "mode": mode,
                "stream": [{"input_ids": p, "max_new_tokens": new_tokens, "kvzap": "decoding"} for p in prompts],
                "engine": {"max_total_tokens": pool_tokens, "max_running_requests": requests,
                           "context_length": prompt_tokens + new_tokens + 16}}
        with tempfile.TemporaryDirectory(prefix="kvzap-bench-sglang-") as tmp:
            (Path(tmp) / "spec.json").write_text(json.dumps(spec))
            done = subprocess.run([python, "-m", "kvzap_export.integrations.sglang.driver", str(Path(tmp) / "spec.json"),
                                   str(Path(tmp) / "out.json")], capture_output=True, text=True,
                                  env={**os.environ, "SGLANG_USE_CPU_ENGINE": os.environ.get("SGLANG_USE_CPU_ENGINE", "1")})
            if done.returncode != 0:
                raise RuntimeError(f"SGLang {mode} run failed:\n{done.stderr[-3000:]}")
            result = json.loads((Path(tmp) / "out.json").read_text())
        row = {"benchmark": "sglang_stream", "mode": mode, "pool_tokens": pool_tokens, "prompt_tokens": prompt_tokens,
               "new_tokens": new_tokens, **summarize_mode(result)}
        rows.append(row)
        if on_mode:
            on_mode(row)
    dense = next((r for r in rows if r["mode"] == "dense"), None)
    if dense:
        for row in rows:
            row["running_vs_dense"] = row["max_running"] / dense["max_running"]
            if row["tokens_per_s_at_saturation"] and dense["tokens_per_s_at_saturation"]:
                row["throughput_vs_dense"] = row["tokens_per_s_at_saturation"] / dense["tokens_per_s_at_saturation"]
    return rows
