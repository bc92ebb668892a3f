"""Engine level: a real serving engine with KVzap attached vs the kvpress reference the bundle carries.

``validate BUNDLE --engine sglang --engine-mode MODE --model DIR`` starts a real ``sglang.Engine`` (in the
engine's own environment: ``--engine-python``, default this Python) with the kvzap plugin loaded through its
entry point, in float32, and runs each prompt greedily, one request at a time, three ways on the same
launch: KVzap off for that request (``custom_params["kvzap"]="off"``: the dense reading), kvpress
``decoding=False`` and ``decoding=True``. Two independent computations meet here: SGLang's tokens vs
kvpress's (transformers, masked run, stored by the model level in ``report/reference.json``), prompt ids for
prompt ids. The KV held comes from SGLang's allocator (and, in ragged mode, from the per-head pool's free
list), read at the request's last step; what the glue's decisions imply is reported beside it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvzap_export.errors import ConfigError
from kvzap_export.validate.reference import lookup, read_reference

ENGINES = ("sglang",)
ENGINE_MODES = ("mask", "evict", "ragged")
DEFAULT_NEW_TOKENS = 64
# Each prompt's runs, in this order, each after the last (SGLang's radix cache on in ragged mode: a KVzap run first,
# so that it takes from the cache what earlier prompts left there, not the whole prompt a run of its own just left)
RUNS = (("prefill", False), ("decoding", True), ("off", None))


def engine_python(given: str | None) -> str:
    """The Python of the engine's environment: ``given``, else ``$KVZAP_SGLANG_PYTHON``, else this one if it has SGLang."""
    candidate = given or os.environ.get("KVZAP_SGLANG_PYTHON")
    if candidate:
        path = shutil.which(candidate) or candidate
        if not Path(path).is_file():
            raise ConfigError(f"--engine-python {candidate}: no such interpreter; give the engine environment's "
                              "python (bash scripts/sglang_cpu_env.sh DIR makes one: DIR/bin/python)")
        return path
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        raise ConfigError("--engine sglang: sglang is not installed in this environment; pass --engine-python "
                          "DIR/bin/python of an environment that has it (bash scripts/sglang_cpu_env.sh DIR on a CPU machine)")
    return sys.executable


def check_engine_gpu(interpreter: str) -> None:
    """``--device cuda``: the engine's own Python must see a CUDA GPU (this process's torch may be a CPU build), else
    a one-line usage error before anything starts."""
    probe = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"
    try:
        code = subprocess.run([interpreter, "-c", probe], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=300).returncode
    except subprocess.TimeoutExpired:
        raise ConfigError(f"--device cuda: the engine's Python ({interpreter}) did not answer within 300 s whether it "
                          "sees a GPU; check that environment, or use --device cpu") from None
    except OSError as exc:
        raise ConfigError(f"--device cuda: cannot run the engine's Python ({interpreter}): {exc.strerror}; give an "
                          "executable interpreter with --engine-python") from None
    if code != 0:
        why = "sees no CUDA GPU" if code == 3 else "could not import torch to look for a GPU"
        raise ConfigError(f"--device cuda: the engine's Python ({interpreter}) {why}; use --device cpu")


def load_prompts(path: str | None, reference: dict | None) -> list[dict]:
    """The prompts to run: the reference's prompt ids by default, or the strings of a JSON list file."""
    if path is None:
        if reference is None or not reference.get("prompts"):
            raise ConfigError("the bundle carries no kvpress reference (report/reference.json; the model level writes it): "
                              "run `kvzap-export validate BUNDLE` in the main environment first, or pass --prompts FILE.json")
        return [{"input_ids": p["prompt_ids"], "source": p.get("source", "")} for p in reference["prompts"]]
    try:
        texts = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--prompts {path}: cannot read a JSON list of strings ({exc})") from None
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise ConfigError(f"--prompts {path}: expected a non-empty JSON list of non-empty strings")
    return [{"text": t, "source": f"--prompts entry {i + 1}"} for i, t in enumerate(texts)]


def _entries(reading: dict | None, mode: str) -> int | None:
    """K/V entries (one token of one KV head of one layer) a reading says are held: the per-head pool's in
    ragged mode, else SGLang's allocator's slots times layers times KV heads."""
    if reading is None:
        return None
    if "ranks" in reading:  # tensor parallelism: each rank holds its own KV heads
        held = [_entries(rank, mode) for rank in reading["ranks"]]
        return None if None in held else sum(held)
    if mode == "ragged":
        return int(reading["head_slots_held"]) if "head_slots_held" in reading else None
    return int(reading["slots_held"]) * int(reading["layers"]) * int(reading["kv_heads"])


def _decided(reading: dict | None) -> int | None:
    """The entries KVzap's decisions imply for a reading's request (every rank's under tensor parallelism)."""
    if not reading:
        return None
    if "ranks" in reading:
        decided = [rank.get("decided_entries") for rank in reading["ranks"]]
        return None if None in decided else sum(decided)
    return reading.get("decided_entries")


def _rank_mismatches(reading: dict | None, mode: str) -> list[str]:
    """Ranks (tensor parallelism) whose own pool holds other than their own heads' decisions imply."""
    return [f"rank {rank.get('tp_rank')} holds {_entries(rank, mode)}, its decisions imply {rank['decided_entries']}"
            for rank in (reading or {}).get("ranks", [])
            if rank.get("decided_entries") is not None and _entries(rank, mode) != rank["decided_entries"]]


def _reading_problem(reading: dict | None, mode: str, decoding: bool | None) -> str | None:
    """Why a reading does not come from the run it claims (decoding None: the KVzap-off run)."""
    if reading is None:
        return "no reading from the engine (the plugin did not record this request)"
    if reading.get("mode") != mode:
        return f"the reading comes from a {reading.get('mode')} server, not {mode}"
    if decoding is None:
        return "KVzap handled the request meant to run without it" if reading.get("kvzap") else None
    if not reading.get("kvzap"):
        return "KVzap left the request alone"
    if reading.get("decoding") is not decoding:
        return f"KVzap ran it with decoding={reading.get('decoding')}"
    return None


def summarize(raw: dict, reference: dict | None, mode: str, new_tokens: int, sources: list[str]) -> dict[str, Any]:
    """Per prompt and decoding setting: tokens vs the reference, KV held vs dense, from the driver's raw result."""
    source = "the per-head pool's free list" if mode == "ragged" else "SGLang's allocator"
    dense = {r["prompt"]: r for r in raw["results"] if r["run"] == "off"}
    rows, problems = [], []
    for r in raw["results"]:
        decoding = None if r["run"] == "off" else r["run"] == "decoding"
        why = _reading_problem(r["reading"], mode, decoding)
        if why:
            problems.append(f"prompt {r['prompt'] + 1} run {r['run']}: {why}")
        if decoding is None:
            continue
        expected = lookup(reference, r["prompt_ids"], decoding, new_tokens)
        base = dense.get(r["prompt"])
        kv_held, kv_dense = _entries(r["reading"], mode), _entries(base and base["reading"], mode)
        decided = _decided(r["reading"])
        row = {"prompt": r["prompt"], "source": sources[r["prompt"]], "prompt_ids": r["prompt_ids"],
               "output_ids": r["output_ids"], "decoding": decoding, "kv_held": kv_held, "kv_dense": kv_dense,
               "freed_fraction": None if not kv_dense or kv_held is None else 1.0 - kv_held / kv_dense,
               "decided_entries": decided, "cached_tokens": r.get("cached_tokens"),
               "matches_reference": None if expected is None else r["output_ids"] == expected,
               "dense_output_ids": base["output_ids"] if base else None,
               "reference_differs_from_dense": None if expected is None or base is None else expected != base["output_ids"]}
        if expected is not None and not row["matches_reference"]:
            got = r["output_ids"]
            row["first_mismatch"] = next((i for i in range(len(expected)) if i >= len(got) or got[i] != expected[i]),
                                         len(expected))
            problems.append(f"prompt {r['prompt'] + 1} decoding={decoding}: tokens differ from kvpress's at step "
                            f"{row['first_mismatch']}")
        if mode in ("evict", "ragged") and decided is not None and kv_held != decided:
            problems.append(f"prompt {r['prompt'] + 1} decoding={decoding}: the engine holds {kv_held} entries, "
                            f"the decisions imply {decided}")
        if "ranks" in (r["reading"] or {}):  # tensor parallelism: what each rank's own pool holds
            row["kv_held_per_rank"] = [_entries(rank, mode) for rank in r["reading"]["ranks"]]
            if mode == "ragged":
                problems += [f"prompt {r['prompt'] + 1} decoding={decoding}: {m}" for m in _rank_mismatches(r["reading"], mode)]
        rows.append(row)
    referenced = [row for row in rows if row["matches_reference"] is not None]
    status = "failed" if problems else ("passed" if rows and len(referenced) == len(rows) else "skipped")
    held = sum(row["kv_held"] or 0 for row in rows)
    dense_total = sum(row["kv_dense"] or 0 for row in rows)
    result = {"status": status, "engine": "sglang", "mode": mode, "max_new_tokens": new_tokens, "engine_info": raw["engine"],
              "prompts": rows, "problems": problems,
              "matching": sum(bool(row["matches_reference"]) for row in rows), "referenced": len(referenced),
              "kv_held": held, "kv_dense": dense_total, "freed_fraction": 1.0 - held / dense_total if dense_total else None,
              "compares": "SGLang greedy tokens (plugin loaded by its entry point) vs kvpress DMSPress(KVzapPress) greedy "
                          f"tokens computed with transformers and stored in the bundle; KV held read from {source}"}
    readings = [r["reading"] for r in raw["results"] if r["reading"]]
    replays = [int(x["decode_graph_replays"]) for x in readings if x.get("decode_graph_replays") is not None]
    if replays:  # ragged mode: decode steps whose forward replayed a CUDA graph, counted since launch (0 on a CPU)
        result["decode_graph_replays"] = max(replays)
    taus = sorted({float(x["threshold"]) for x in readings if x.get("threshold") is not None})
    if taus:  # the τ in effect, as the engine's readings give it
        result["threshold_in_effect"] = taus
    budgets = [r["reading"]["kv_budget"] for r in raw["results"] if (r["reading"] or {}).get("kv_budget")]
    if budgets:  # ragged mode: SGLang's KV budget and what the per-head pool takes of it
        result["kv_budget"] = budgets[-1]
    if status == "skipped":
        result["reason"] = (f"no kvpress reference for {len(rows) - len(referenced)} of {len(rows)} runs "
                            "(prompts the model level did not store): tokens reported, not compared")
    result["summary"] = (f"{result['matching']}/{len(referenced)} runs with tokens identical to kvpress's "
                         f"({len(rows) - len(referenced)} without a reference); KV held {held} of {dense_total} entries "
                         f"(freed {result['freed_fraction'] or 0.0:.1%}, read from {source})")
    return result


def check_reference(reference: dict | None, manifest: dict) -> None:
    """A reference computed with other pruning settings or another surrogate than the bundle's is refused."""
    if reference is None:
        return
    press, pruning = reference.get("press", {}), manifest["pruning"]
    stale = [f"{name} {press.get(key)!r} vs {ours!r}" for name, key, ours in (
        ("threshold", "threshold", pruning["threshold"]), ("window", "sliding_window_size", pruning["window"]),
        ("variant", "variant", manifest["surrogate"]["variant"])) if press.get(key) != ours]
    theirs, ours = press.get("surrogate_sha256"), manifest["surrogate"].get("sha256")
    if theirs and ours and theirs != ours:
        stale.append("surrogate weights differ")
    if stale:
        raise ConfigError(f"the bundle's kvpress reference (report/reference.json) does not match its manifest "
                          f"({'; '.join(stale)}); re-run `kvzap-export validate BUNDLE` to recompute it")


def run_engine_level(bundle: Path, manifest: dict, engine: str, mode: str, model: str | None, prompts: str | None = None,
                     new_tokens: int | None = None, python: str | None = None, device: str = "cpu",
                     engine_args: dict | None = None, on_line=None, on_start=None) -> dict[str, Any]:
    """Runs the engine level; returns its result dict (``status`` passed | failed | skipped). ``on_start()`` once every
    input is checked, just before the engine is launched."""
    if engine not in ENGINES:
        raise ConfigError(f"--engine {engine!r}: supported engines are {list(ENGINES)}")
    if mode not in ENGINE_MODES:
        raise ConfigError(f"--engine-mode {mode!r}: use one of {list(ENGINE_MODES)}")
    if model is None or not (Path(model) / "config.json").is_file():
        raise ConfigError(f"--engine sglang needs --model DIR, a Hugging Face model directory (got {model!r}); for the "
                          "embedded model: kvzap-export export-model smollm2-135m --out DIR")
    if manifest["dtype"] != "float32":
        raise ConfigError(f"the engine level runs in float32 against the float32 reference; this bundle is {manifest['dtype']}")
    reference = read_reference(bundle)
    check_reference(reference, manifest)
    chosen = load_prompts(prompts, reference)
    stored = reference["max_new_tokens"] if reference else DEFAULT_NEW_TOKENS
    new_tokens = new_tokens or stored
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {new_tokens!r} must be a positive integer")
    interpreter = engine_python(python)
    if device == "cuda":
        check_engine_gpu(interpreter)
    spec = {"model": str(Path(model).absolute()), "bundle": str(Path(bundle).absolute()), "mode": mode,
            "dtype": "float32",  # the kvpress reference's; the driver's own default on a GPU is bfloat16
            "prompts": [{k: v for k, v in p.items() if k != "source"} for p in chosen], "runs": [r for r, _ in RUNS],
            "max_new_tokens": new_tokens, "engine": engine_args or {}}
    with tempfile.TemporaryDirectory(prefix="kvzap-engine-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ)
        if device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        cmd = [interpreter, "-m", "kvzap_export.integrations.sglang.driver", str(spec_path), str(out_path)]
        if on_start:
            on_start()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        tail: list[str] = []
        for line in proc.stderr:
            line = line.rstrip()
            if line.startswith("kvzap-sglang-driver:") and on_line:
                on_line(line.split(":", 1)[1].strip())
            if line.startswith("kvzap-export:"):
                tail.append(line)  # our own one-line refusals
            elif line and not line.startswith(" "):
                tail = (tail + [line])[-20:]
        if proc.wait() != 0 or not out_path.is_file():
            ours = [t for t in tail if t.startswith("kvzap-export:")]
            why = ours[-1] if ours else (tail[-1] if tail else f"exit code {proc.returncode}")
            return {"status": "failed", "engine": engine, "mode": mode, "error": why, "log_tail": tail,
                    "summary": f"the SGLang engine did not run to the end: {why}"}
        raw = json.loads(out_path.read_text())
    return summarize(raw, reference, mode, new_tokens, [p["source"] for p in chosen])


def write_engine_report(bundle: Path, result: dict) -> Path:
    """``report/engine-<engine>-<mode>.{json,md}``: the whole result, and a per-prompt table."""
    directory = Path(bundle) / "report"
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"engine-{result['engine']}-{result['mode']}"
    (directory / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    mark = {"passed": "✓", "failed": "✗"}.get(result["status"], "–")
    lines = [f"# Engine level: {result['engine']} ({result['mode']} mode) {mark} {result['status']}", "",
             result.get("compares", ""), "", result["summary"], ""]
    resolved = (result.get("engine_info") or {}).get("resolved")
    if resolved:  # what SGLang made of its defaults on this machine (its chunk size, the radix cache, overlap)
        lines += ["SGLang's settings as it resolved them: " + ", ".join(f"`{k}={v}`" for k, v in resolved.items()), ""]
    if result.get("decode_graph_replays") is not None:
        lines += [f"Decode steps that replayed a CUDA graph (the engine's count since launch): "
                  f"{result['decode_graph_replays']}; τ in effect: {result.get('threshold_in_effect')}.", ""]
    budget = result.get("kv_budget")
    if budget:  # ragged mode: the per-head pool and its bookkeeping inside the KV budget SGLang profiled
        parts = ", ".join(f"{part.replace('_', ' ')} {size / 2**30:.3f}" for part, size in budget.items() if part != "budget")
        lines += [f"SGLang's KV budget {budget['budget'] / 2**30:.3f} GB holds the per-head pool (GB): {parts}.", ""]
    if result.get("reason"):
        lines += [f"Not passed: {result['reason']}.", ""]
    if result.get("error"):
        lines += [f"Error: {result['error']}", ""]
    if result.get("prompts"):
        lines += ["| prompt | decoding | tokens vs kvpress | kvpress differs from dense | KV held | KV dense | freed | "
                  "prompt tokens from SGLang's radix cache |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in result["prompts"]:
            same = {True: "identical", False: f"differ at step {row.get('first_mismatch')}", None: "no reference"}[
                row["matches_reference"]]
            differs = {True: "yes", False: "no", None: "–"}[row["reference_differs_from_dense"]]
            freed = "–" if row["freed_fraction"] is None else f"{row['freed_fraction']:.1%}"
            cached = "–" if row.get("cached_tokens") is None else row["cached_tokens"]
            lines.append(f"| {row['prompt'] + 1} | {row['decoding']} | {same} | {differs} | {row['kv_held']} | "
                         f"{row['kv_dense']} | {freed} | {cached} |")
        lines.append("")
    for problem in result.get("problems", []):
        lines.append(f"- ✗ {problem}")
    (directory / f"{stem}.md").write_text("\n".join(lines) + "\n")
    return directory / f"{stem}.md"
