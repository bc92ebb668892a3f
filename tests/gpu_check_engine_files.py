"""What gpu_check.sh's SGLang steps leave in OUTDIR, written by hand for the summary's tests (plumbing, not a GPU
measurement): every step ran and passed; the keywords break one part of it."""

from __future__ import annotations

import json
from pathlib import Path

GPU = "NVIDIA H200"
MODES = ("ragged", "mask", "evict")
BACKEND = {"ragged": "kvzap_ragged", "mask": "kvzap_flex", "evict": "kvzap_flex"}


def parity(mode: str, status: str = "passed", replays: int | None = 40) -> dict:
    out = {"status": status, "engine": "sglang", "mode": mode, "matching": 6 if status == "passed" else 5, "referenced": 6,
           "summary": f"{6 if status == 'passed' else 5}/6 runs with tokens identical to kvpress's", "freed_fraction": 0.3,
           "problems": [] if status == "passed" else ["prompt 2 decoding=True: tokens differ from kvpress's at step 7"],
           "engine_info": {"args": {"attention_backend": BACKEND[mode]}}}
    if mode == "ragged" and replays is not None:
        out.update(decode_graph_replays=replays, threshold_in_effect=[0.0])
    return out


def _run(label: str, mode: str, tps: float, running: int, fraction=None, kvzap="decoding", replays=None, used=30e9):
    return {"round": 1, "label": label, "mode": mode, "kvzap": kvzap, "pruned_fraction": fraction,
            "gpu_memory": {"used_bytes": used, "total_bytes": 140e9, "mem_fraction_static": 0.8},
            "figures": {"tokens_per_s": tps, "max_running": running, "freed_at_peak": 0.6 if kvzap == "decoding" and
                        mode == "ragged" else 0.0, "kv_peak_entries": 1000, "threshold_in_effect": -0.1 if fraction else None,
                        "decode_graph_replays": replays, "wall_s": 20.0, "launch_s": 40.0}}


def bench(prompt_tokens: int, *, tps=None, replays: int = 500, rounds: int = 1, device: str = GPU) -> dict:
    """A bench --engine sglang report: dense, ragged at 70% and 40% pruned and with KVzap off (8k), or dense and ragged
    at 70% (32k); ``tps``: tokens/s per label."""
    tps = {"dense": 100.0, "ragged, 70% pruned": 180.0, "ragged, 40% pruned": 110.0, "ragged, KVzap off": 95.0} | (tps or {})
    runs = [_run("dense", "dense", tps["dense"], 3), _run("ragged, 70% pruned", "ragged", tps["ragged, 70% pruned"], 9, 0.7,
                                                           replays=replays)]
    if prompt_tokens == 8192:
        runs += [_run("ragged, 40% pruned", "ragged", tps["ragged, 40% pruned"], 5, 0.4, replays=replays),
                 _run("ragged, KVzap off", "ragged", tps["ragged, KVzap off"], 3, 0.7, kvzap="off", replays=replays)]
    summary = {r["label"]: {k: {"median": v} for k, v in r["figures"].items()} for r in runs}
    vs = {r["label"]: {"tokens_per_s_ratio": r["figures"]["tokens_per_s"] / tps["dense"]} for r in runs[1:]}
    return {"machine": device, "device": "cuda", "settings": {"prompt_tokens": prompt_tokens, "rounds": rounds, "requests": 12,
                                                          "new_tokens": 512, "pool_tokens": 26118},
            "runs": runs, "summary": summary, "vs_dense": vs}


def write_engine_run(out: Path, *, parity_status: dict | None = None, replays: int | None = 40, bench_replays: int = 500,
                     tps=None, absent=(), device: str = GPU) -> dict[str, str]:
    """Writes the engine steps' files into ``out``; returns their steps.tsv rows (NAME -> "rc\\tseconds\\tcut").
    ``parity_status``: (model, mode) -> validate's status; ``absent``: files not written."""
    rows = {"engine_install": "0\t20\t0", "engine_dummy_bundle": "0\t8\t0"}
    for model in ("llama", "qwen3"):
        for mode in MODES:
            name = f"engine_parity_{model}_{mode}"
            status = (parity_status or {}).get((model, mode), "passed")
            rc = {"passed": 0, "failed": 1, "skipped": 3}[status]  # validate's exit status
            rows[name] = f"{rc}\t50\t0"
            if f"{name}.json" not in absent:
                (out / f"{name}.json").write_text(json.dumps(parity(mode, status, replays)))
    for name, tokens in (("engine_bench_8k", 8192), ("engine_bench_32k", 32768)):
        rows[name] = "0\t200\t0"
        file = f"engine-bench-{tokens // 1024}k.json"
        if file not in absent:
            (out / file).write_text(json.dumps(bench(tokens, tps=tps, replays=bench_replays, device=device)))
    (out / "engine-settings.json").write_text(json.dumps({"fused_op_backend": "torch"}))
    return rows
