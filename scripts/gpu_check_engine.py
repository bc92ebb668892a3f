"""The SGLang part of a ``scripts/gpu_check.sh`` run, for ``gpu_check_summary.py``: its checks, figures and targets.

What the engine steps leave in OUTDIR (gpu_check.sh, step 8):
- ``engine_parity_<model>_<mode>.json``: ``validate --engine sglang --json`` on a tiny model's bundle (``llama``,
  ``qwen3``; modes ragged, mask, evict): SGLang's greedy tokens on the GPU vs kvpress's, computed on a CPU machine and
  carried in the bundle (two independent computations). Passed, failed, or not run (validate's "skipped": no
  reference to compare with) as validate says; in ragged mode also the engine's count of decode steps that replayed a
  CUDA graph: 0 fails (ragged mode runs SGLang's decode graphs), absent is not run;
- ``engine-bench-8k.json`` / ``engine-bench-32k.json``: ``bench --engine sglang --device cuda --load-format dummy`` at
  Llama-3.1-8B's shapes: one row per run (output tokens/s, requests running at most, entries freed, τ in effect, the
  replay count, the device's memory at the stream's end beside SGLang's static plan); a ragged run that replayed no
  decode graph fails; the targets (reported, not gating): ragged at 70% pruned >= 1.5x dense and at 40% >= 1.2x
  (8k prompts), with KVzap's own share (ragged vs ragged with KVzap off) and the requests running beside each; ragged's
  device memory within dense's (the per-head pool lives inside the KV budget SGLang planned). A run whose launch failed
  (the benchmark goes on with the others and exits 1) fails.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

MODELS = {"llama": "tiny Llama", "qwen3": "tiny Qwen3"}
MODES = ("ragged", "mask", "evict")
PARITY_STEPS = tuple(f"engine_parity_{model}_{mode}" for model in MODELS for mode in MODES)
BENCHES = {"engine_bench_8k": "engine-bench-8k.json", "engine_bench_32k": "engine-bench-32k.json"}
# beside each, ``<file minus .json>.runs.jsonl`` (bench --save-runs): the settings, then each run as it finished
ENGINE_STEPS = ("engine_install", "engine_dummy_bundle", *PARITY_STEPS, *BENCHES)
SPEEDUP_TARGETS = ((0.7, 1.5), (0.4, 1.2))  # pruned fraction -> ragged / dense output tokens/s, 8k prompts
TARGET_PROMPT_TOKENS, MEMORY_SLACK = 8192, 1.02
NOT_STARTED = ("skipped", "missing", "absent")


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _check(name: str, status: str, detail) -> dict:
    return {"check": name, "status": status, "detail": detail}


def _absent(name: str, path: Path, step: dict) -> list[dict]:
    """A check whose output file is absent: not run, unless its step never started (the step's own line lists it)."""
    if step["rc"] in NOT_STARTED:
        return []
    return [_check(name, "not run", f"{path.name} is absent (step {step['step']}: {step['result']['detail']})")]


def _target(name: str, value, limit: str, met, device: str, note: str = "") -> dict:
    return {"target": name, "value": value, "limit": limit, "met": None if value is None else met, "device": device,
            **({"note": note} if note else {})}


def parity_checks(out: Path, steps: dict) -> list[dict]:
    checks = []
    for name in PARITY_STEPS:
        model, mode = name.split("_")[2:]
        label = f"SGLang engine parity, {MODELS[model]}, {mode} mode: SGLang's greedy tokens vs kvpress's (computed on a CPU)"
        data = _json(out / f"{name}.json")
        if data is None:
            checks += _absent(label, out / f"{name}.json", steps[name])
            if mode == "ragged" and steps[name]["rc"] not in NOT_STARTED:
                checks.append(_check(f"SGLang ragged mode, {MODELS[model]}: decode steps replayed a CUDA graph",
                                     "not run", f"{name}.json is absent"))
            continue
        status = {"passed": "passed", "failed": "failed"}.get(data.get("status"), "not run")
        detail = data.get("summary") or data.get("error") or data.get("status")
        if data.get("problems"):
            detail += f"; problems: {data['problems'][:3]}"
        if data.get("reason"):
            detail += f"; {data['reason']}"
        args = (data.get("engine_info") or {}).get("args") or {}
        checks.append({**_check(label, status, detail), "mode": mode, "model": model,
                       "engine_device": args.get("device") or ("cuda" if args else None),
                       "matching": data.get("matching"), "referenced": data.get("referenced"),
                       "freed_fraction": data.get("freed_fraction"),
                       "attention_backend": args.get("attention_backend")})
        if mode == "ragged":
            replays = data.get("decode_graph_replays")
            why = ("the engine did not run to the end" if data.get("error") else "its readings carry no replay count")
            checks.append(_check(f"SGLang ragged mode, {MODELS[model]}: decode steps replayed a CUDA graph",
                                 "not run" if replays is None else "passed" if replays > 0 else "failed",
                                 why if replays is None else f"{replays} decode steps replayed a CUDA graph "
                                 f"(τ in effect {data.get('threshold_in_effect')})"))
    return checks


def _row(run: dict, data: dict, device: str) -> dict:
    figures, memory, settings = run["figures"], run.get("gpu_memory") or {}, data.get("settings", {})
    static = (memory.get("mem_fraction_static") or 0) * memory.get("total_bytes", 0)
    cut = " (partial: the benchmark was cut short)" if data.get("partial") else ""
    return {"source": f"SGLang stream, Llama-3.1-8B shapes (dummy weights), {settings.get('prompt_tokens')} prompt tokens"
                      f"{cut}",
            "device": device, "config": run["label"], "round": run["round"], "pruned_fraction": run.get("pruned_fraction"),
            "tokens_per_s": figures.get("tokens_per_s"), "max_running": figures.get("max_running"),
            "freed_at_peak": figures.get("freed_at_peak"), "kv_peak_entries": figures.get("kv_peak_entries"),
            "threshold_in_effect": figures.get("threshold_in_effect"),
            "decode_graph_replays": figures.get("decode_graph_replays"),
            "gpu_gb_at_end": memory["used_bytes"] / 1e9 if memory else None,
            "sglang_static_plan_gb": static / 1e9 if memory else None,
            "requests": settings.get("requests"), "new_tokens": settings.get("new_tokens"),
            "pool_tokens": settings.get("pool_tokens"), "wall_s": figures.get("wall_s"), "launch_s": figures.get("launch_s")}


def _median(data: dict, label: str, key: str):
    """The median over the rounds of one configuration's figure, from its runs (a partial report has no summary)."""
    values = [r["figures"].get(key) for r in data.get("runs") or [] if r["label"] == label]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _saved_runs(path: Path) -> dict | None:
    """A benchmark cut short: its ``--save-runs`` lines as a partial report (settings, the runs that finished, errors)."""
    try:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return None
    if not lines or "settings" not in lines[0]:
        return None
    return {"settings": lines[0]["settings"], "machine": lines[0].get("machine"), "partial": True,
            "runs": [line for line in lines[1:] if "figures" in line],
            "errors": [line for line in lines[1:] if "error" in line]}


def bench_parts(out: Path, steps: dict, gpu: str) -> tuple[list[dict], list[dict], list[dict]]:
    figures, checks, targets = [], [], []
    for name, file in BENCHES.items():
        data = _json(out / file) or _saved_runs(out / file.replace(".json", ".runs.jsonl"))
        label = f"SGLang stream benchmark ({file})"
        if data is None:
            checks += _absent(label, out / file, steps[name])
            if name == "engine_bench_8k":
                targets += [_target(f"ragged at {f:.0%} pruned vs dense, output tokens/s (8k prompts, Llama-3.1-8B "
                                    "shapes, bf16)", None, f">= {x}x", None, gpu) for f, x in SPEEDUP_TARGETS]
            continue
        device = data.get("machine") or gpu
        runs = data.get("runs") or []
        if data.get("partial"):
            checks.append(_check(f"{label}: the whole benchmark", "not run", f"cut short: {file} is absent; "
                                 f"{len(runs)} run(s) saved as they finished are reported"))
        if data.get("errors"):
            checks.append(_check(f"{label}: runs that failed", "failed",
                                 [f"{e.get('label')}: {e.get('error')}" for e in data["errors"]]))
        figures += [_row(run, data, device) for run in runs]
        ragged = [r for r in runs if r.get("mode") == "ragged"]
        zero = [r["label"] for r in ragged if r["figures"].get("decode_graph_replays") == 0]
        unknown = [r["label"] for r in ragged if r["figures"].get("decode_graph_replays") is None]
        if ragged:
            checks.append(_check(f"{label}: ragged runs replayed decode CUDA graphs",
                                 "failed" if zero else "not run" if unknown else "passed",
                                 f"no replay in {zero}" if zero else f"no count in {unknown}" if unknown else
                                 {r["label"]: r["figures"]["decode_graph_replays"] for r in ragged}))
        settings = data.get("settings", {})
        rounds = settings.get("rounds")
        basis = f"{rounds} round{'s' * (rounds != 1)}" + (": one run per configuration, not a median" if rounds == 1 else
                                                         ", medians")
        dense_gb = next((r["gpu_memory"]["used_bytes"] for r in runs if r["mode"] == "dense" and r.get("gpu_memory")), None)
        for run in (r for r in ragged if r.get("gpu_memory") and r["kvzap"] == "decoding"):
            used = run["gpu_memory"]["used_bytes"]
            targets.append(_target(f"{settings.get('prompt_tokens')} prompts: GPU memory at the stream's end, "
                                   f"{run['label']} / dense", used / dense_gb if dense_gb else None, f"<= {MEMORY_SLACK}",
                                   bool(dense_gb) and used / dense_gb <= MEMORY_SLACK, device,
                                   f"{used / 1e9:.1f} GB vs dense {(dense_gb or 0) / 1e9:.1f} GB (NVML, whole device; "
                                   "same KV budget and SGLang memory plan)"))
        if settings.get("prompt_tokens") != TARGET_PROMPT_TOKENS:
            continue
        off = "ragged, KVzap off"
        for fraction, limit in SPEEDUP_TARGETS:
            config = f"ragged, {fraction:.0%} pruned"
            mine, theirs = _median(data, config, "tokens_per_s"), _median(data, off, "tokens_per_s")
            dense = _median(data, "dense", "tokens_per_s")
            ratio = mine / dense if mine and dense else None
            share = mine / theirs if mine and theirs else None
            running = {c: _median(data, c, "max_running") for c in ("dense", config, off)}
            note = (f"KVzap's own share (vs {off}) {share:.2f}x; " if share else f"KVzap's own share: no {off} run; ")
            note += (f"requests running at most: dense {running['dense']}, {config} {running[config]}, {off} "
                     f"{running[off]}; τ {_median(data, config, 'threshold_in_effect')} set by the pruned fraction "
                     f"(dummy weights give meaningless scores); {basis}")
            targets.append(_target(f"ragged at {fraction:.0%} pruned vs dense, output tokens/s (8k prompts, Llama-3.1-8B "
                                   "shapes, bf16)", ratio, f">= {limit}x", ratio is not None and ratio >= limit, device,
                                   note))
    return figures, checks, targets


def engine_parts(out: Path, steps: dict, device: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(figures, checks, targets) of the engine steps; ``steps``: every step with its ``result`` (gpu_check_summary);
    ``device``: the run's GPU, where a report does not name it."""
    figures, checks, targets = bench_parts(out, steps, device)
    settings = _json(out / "engine-settings.json")
    if settings:
        figures.append({"source": "SGLang engine settings of this run", "device": device, **settings})
    return figures, parity_checks(out, steps) + checks, targets


def engine_device(out: Path) -> str | None:
    for file in BENCHES.values():
        machine = (_json(out / file) or {}).get("machine")
        if machine:
            return machine
    return None
