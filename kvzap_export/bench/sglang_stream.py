"""SGLang at a fixed KV budget: dense vs KVzap's evict mode vs its ragged (per-head) mode, interleaved rounds.

Each run launches a real ``sglang.Engine`` (the engine environment's Python; ``integrations/sglang/driver``) with
the same KV budget (``--max-total-tokens``) and server flags, and submits the same stream of requests at once
(prompts of ``prompt_tokens`` tokens, distinct, or sharing their first ``shared`` tokens, ``new_tokens`` greedy
tokens each, ``ignore_eos``). Rounds interleave the configurations (``CONFIGS``, chosen by ``--configs``; default
dense, evict, ragged[, ragged at a second threshold], ragged with KVzap off, ragged at dense's concurrency), so that a
slow period of the machine hits every configuration alike; every figure is given as the median over rounds with its
spread (``stream_figures``). Dense is SGLang without KVzap (readings only) on the fastest setting that runs here: each
attention backend, with SGLang's overlap scheduler off and on, serves a short probe stream first, and the fastest is
the baseline's; with prompts that share a prefix, the baseline is dense with SGLang's radix cache on ("dense, radix":
the prefix prefilled and held once), the best dense SGLang does there. KVzap's modes run with SGLang's overlap
scheduler on (its default; ``kvzap_overlap=False`` turns it off: on a CPU engine overlap gains nothing; SGLang
caches a batch's prompts only once it has processed that batch's result, so under overlap ragged mode holds a request
that shares a prefix with the prefill in flight for one batch, ``ragged_radix.prefill_hold_hook``) and the radix
cache as the
configuration says ("ragged, radix":
prompts' per-head entries shared exactly, docs/ragged-kv.md). "Ragged, KVzap off" is
the ragged mode's storage and attention with every request asking for KVzap off: it holds every entry, as dense
does, so what it gains over dense is the implementation, and what ragged gains over it is the memory KVzap freed.
"Ragged at dense's concurrency" caps the ragged mode at the requests the baseline ran at once in that round
(``--max-running-requests``), so that its decode step is timed at the baseline's batch size.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from kvzap_export.bench.stream_figures import compare, run_figures, summarize
from kvzap_export.errors import ConfigError

MODES = ("dense", "evict", "ragged")
CPU_DENSE_BACKENDS = ("torch_native", "flex_attention")  # SGLang's attention backends that run on a CPU here


def check_shared_prefix(shared: int, tokens: int) -> None:
    if not 0 <= shared < tokens:
        raise ConfigError(f"--shared-prefix-tokens {shared}: must be at least 0 and below --prompt-tokens {tokens} "
                          "(each request needs a distinct part)")


def stream_prompts(tokenizer, count: int, tokens: int, shared: int = 0) -> list[list[int]]:
    """``count`` prompts of ``tokens`` tokens from Python's own documentation (pydoc topics). ``shared``: the first
    ``shared`` tokens are the same in every prompt (the text's opening: a system prompt), the rest distinct (0: every
    prompt distinct from its first token)."""
    from pydoc_data.topics import topics

    check_shared_prefix(shared, tokens)
    ids = tokenizer("\n\n".join(topics[k] for k in sorted(topics)))["input_ids"]
    if len(ids) < shared + count * (tokens - shared):
        raise ConfigError(f"not enough text for {count} prompts of {tokens} tokens ({len(ids)} tokens of text); "
                          "ask for fewer --requests or --prompt-tokens")
    prefix, rest = ids[:shared], ids[shared:]
    step = len(rest) // count
    return [prefix + rest[i * step: i * step + tokens - shared] for i in range(count)]


# The configurations ``--configs`` chooses from: key -> (label, mode, each request's custom_params kvzap, radix cache
# on, cap on running requests). "dense" and "dense-radix" are SGLang without KVzap (readings only) on the baseline's
# attention backend, the radix cache off / on; "ragged-radix" is the ragged mode with the radix cache on (its default:
# prompts' per-head entries shared exactly, docs/ragged-kv.md); "ragged-off" is the ragged mode's storage and attention with every
# request asking for KVzap off (it holds every entry, as dense does: what it gains over dense is the implementation,
# what ragged gains over it is KVzap's own share); "ragged-at-dense" caps the ragged mode at the requests the baseline
# ran at once in that round (its decode step timed at the baseline's batch size); "ragged-radix-off" is "ragged-off"
# with the radix cache on (KVzap's own share beside "ragged-radix").
CONFIGS = {
    "dense": ("dense", "dense", "decoding", False, None),
    "dense-radix": ("dense, radix", "dense", "decoding", True, None),
    "evict": ("evict", "evict", "decoding", False, None),
    "ragged": ("ragged", "ragged", "decoding", False, None),
    "ragged-off": ("ragged, KVzap off", "ragged", "off", False, None),
    "ragged-radix": ("ragged, radix", "ragged", "decoding", True, None),
    "ragged-radix-off": ("ragged, radix, KVzap off", "ragged", "off", True, None),
    "ragged-at-dense": ("ragged at dense's concurrency", "ragged", "decoding", False, "baseline"),
}
DEFAULT_CONFIGS = ("dense", "evict", "ragged", "ragged-off", "ragged-at-dense")


def parse_configs(text: str) -> tuple[str, ...]:
    """``--configs``: known keys, at least one dense one (the baseline: ``dense-radix`` when chosen, the best dense
    SGLang does when prompts share a prefix, else ``dense``)."""
    chosen = tuple(dict.fromkeys(c.strip() for c in text.split(",") if c.strip()))
    unknown = [c for c in chosen if c not in CONFIGS]
    if unknown or not chosen:
        raise ConfigError(f"--configs {text!r}: unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS)}")
    if not {"dense", "dense-radix"} & set(chosen):
        raise ConfigError(f"--configs {text!r}: needs dense or dense-radix (the baseline every ratio is taken against)")
    return chosen


def baseline_of(configs: tuple[str, ...]) -> str:
    return CONFIGS["dense-radix" if "dense-radix" in configs else "dense"][0]


def run_stream(python: str, spec: dict) -> dict:
    """One engine launch serving ``spec``'s stream (the driver's result)."""
    with tempfile.TemporaryDirectory(prefix="kvzap-bench-sglang-") as tmp:
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        done = subprocess.run([python, "-m", "kvzap_export.integrations.sglang.driver", str(Path(tmp) / "spec.json"),
                               str(Path(tmp) / "out.json")], capture_output=True, text=True,
                              env={**os.environ, "SGLANG_USE_CPU_ENGINE": os.environ.get("SGLANG_USE_CPU_ENGINE", "1")})
        if done.returncode != 0:
            raise RuntimeError(f"SGLang {spec['mode']} run failed:\n{done.stderr[-3000:]}")
        return json.loads((Path(tmp) / "out.json").read_text())


class StreamBench:
    """The benchmark's settings and the runs it made (see the module docstring)."""

    def __init__(self, bundle: str, model: str, python: str, requests: int = 32, prompt_tokens: int = 1024,
                 new_tokens: int = 96, pool_tokens: int | None = None, engine: dict | None = None, shared: int = 0):
        from transformers import AutoTokenizer

        self.bundle, self.model, self.python = str(Path(bundle).absolute()), str(Path(model).absolute()), python
        self.requests, self.prompt_tokens, self.new_tokens = requests, prompt_tokens, new_tokens
        # 8 requests' worth: SGLang charges a request its prompt + max_new_tokens + 1 and admits while the next one is
        # strictly below what is left, so 8 * (prompt + new) would fit 7 and leave most of a request's room unused.
        self.pool_tokens = pool_tokens or 8 * (prompt_tokens + new_tokens + 2)
        self.shared = shared
        self.prompts = stream_prompts(AutoTokenizer.from_pretrained(model), requests, prompt_tokens, shared)
        self.engine = {"max_total_tokens": self.pool_tokens, "max_running_requests": requests,
                       "context_length": prompt_tokens + new_tokens + 16, **(engine or {})}

    def spec(self, mode: str, threshold: float | None = None, backend: str | None = None, requests: int | None = None,
             new_tokens: int | None = None, choice: str = "decoding", running: int | None = None,
             radix: bool = False, overlap: bool | None = None) -> dict:
        prompts = self.prompts[: requests or self.requests]
        engine = dict(self.engine, **({"attention_backend": backend} if backend else {}))
        if running:
            engine["max_running_requests"] = running
        engine["disable_radix_cache"] = not radix  # whatever the mode's default (ragged mode's is on)
        if overlap is not None:  # None: the driver's setting (SGLang's default: on)
            engine["disable_overlap_schedule"] = not overlap
        return {"model": self.model, "bundle": self.bundle, "mode": mode, "threshold": threshold, "engine": engine,
                "stream": [{"input_ids": p, "max_new_tokens": new_tokens or self.new_tokens, "kvzap": choice}
                           for p in prompts]}

    def provenance(self) -> dict:
        """What fixes the figures: the prompts (hash of their ids), the bundle's surrogate and pruning settings."""
        manifest = json.loads((Path(self.bundle) / "manifest.json").read_text())
        digest = hashlib.sha256(json.dumps(self.prompts).encode()).hexdigest()
        return {"prompts_sha256": digest, "prompt_source": "pydoc_data.topics of this Python",
                "shared_prefix_tokens": self.shared,
                "surrogate": {k: manifest["surrogate"].get(k) for k in ("variant", "source", "sha256")},
                "pruning": manifest.get("pruning")}

    def probe_dense(self, candidates: tuple[str, ...], on_event=None, radix: bool = False) -> dict:
        """Each dense backend, with SGLang's overlap scheduler off and on (its default, which ragged mode keeps),
        serves the first 8 requests with 32 new tokens, with the radix cache as the baseline runs it (``radix``: the
        baseline is "dense, radix", and the 8 prompts share the workload's prefix); the fastest setting is the
        baseline's."""
        found = {}
        for backend in candidates:
            for overlap in (False, True):
                name = f"{backend}, overlap {'on' if overlap else 'off'}"
                spec = self.spec("dense", backend=backend, requests=min(8, self.requests),
                                 new_tokens=min(32, self.new_tokens), overlap=overlap, radix=radix)
                try:
                    figures = run_figures(run_stream(self.python, spec))
                    found[name] = {"backend": backend, "overlap": overlap, "tokens_per_s": figures["tokens_per_s"],
                                   "wall_s": figures["wall_s"]}
                except RuntimeError as exc:
                    found[name] = {"backend": backend, "overlap": overlap, "error": str(exc).splitlines()[-1][:300]}
                if on_event:
                    on_event(f"dense probe: {name}: " + (f"{found[name]['tokens_per_s']:.2f} tokens/s"
                                                         if "tokens_per_s" in found[name] else "failed"))
        usable = {b: f for b, f in found.items() if "tokens_per_s" in f}
        if not usable:
            raise RuntimeError(f"no dense attention backend ran: {found}")
        best = usable[max(usable, key=lambda b: usable[b]["tokens_per_s"])]
        return {"candidates": found, "chosen": best["backend"], "overlap": best["overlap"],
                "probe": {"requests": min(8, self.requests), "new_tokens": min(32, self.new_tokens), "radix_cache": radix}}


def bench_sglang(bundle: str, model: str, python: str, requests: int = 32, prompt_tokens: int = 1024, new_tokens: int = 96,
                 pool_tokens: int | None = None, rounds: int = 3, threshold: float | None = None,
                 dense_backends: tuple[str, ...] = CPU_DENSE_BACKENDS, engine: dict | None = None,
                 on_event=None, configs: tuple[str, ...] = DEFAULT_CONFIGS, shared: int = 0,
                 kvzap_overlap: bool = True) -> dict:
    """Interleaved rounds of every configuration; returns the settings, each run's figures, the medians with
    spread per configuration and the comparisons with the baseline (``stream_figures.summarize`` / ``compare``)."""
    bench = StreamBench(bundle, model, python, requests, prompt_tokens, new_tokens, pool_tokens, engine, shared)
    baseline = baseline_of(configs)
    dense = bench.probe_dense(dense_backends, on_event, radix=baseline == CONFIGS["dense-radix"][0])
    # (label, mode, threshold, attention backend, each request's custom_params kvzap, radix cache, cap on running);
    # the dense configurations take the probe's overlap setting, KVzap's SGLang's default (on: None leaves it to the
    # driver) unless kvzap_overlap is False
    kvzap_overlap_arg = None if kvzap_overlap else False
    plan = []
    for key in configs:
        label, mode, choice, radix, running = CONFIGS[key]
        plan.append((label, mode, None, dense["chosen"] if mode == "dense" else None, choice, radix, running))
        if key == "ragged" and threshold is not None:
            plan.append((f"ragged τ={threshold:g}", "ragged", threshold, None, "decoding", False, None))
    # a run capped at the baseline's concurrency needs the baseline's run of its round first
    plan.sort(key=lambda c: c[6] == "baseline")
    runs, started = [], time.perf_counter()
    total = rounds * len(plan)
    for number in range(1, rounds + 1):
        base_running = None
        for label, mode, tau, backend, choice, radix, running in plan:
            cap = base_running if running == "baseline" else None
            if running == "baseline" and not cap:
                raise ConfigError(f"'ragged at dense's concurrency' needs {baseline}'s most running requests of the round, "
                                  "but it ran no decode step; give --new-tokens 2 or more")
            result = run_stream(python, bench.spec(mode, tau, backend, choice=choice, running=cap, radix=radix,
                                                   overlap=dense["overlap"] if mode == "dense" else kvzap_overlap_arg))
            figures = run_figures(result)
            if label == baseline:
                base_running = figures["max_running"]
            args = result["engine"]["args"]
            runs.append({"round": number, "label": label, "mode": mode, "threshold": tau, "kvzap": choice,
                         "radix_cache": not args.get("disable_radix_cache", False),
                         "overlap_schedule": not args.get("disable_overlap_schedule", False),
                         "sglang_resolved": result["engine"].get("resolved", {}),
                         "max_running_requests": args.get("max_running_requests"),
                         "attention_backend": args.get("attention_backend"), "figures": figures})
            if on_event:
                elapsed = time.perf_counter() - started
                eta = elapsed / len(runs) * (total - len(runs))
                on_event(f"[{len(runs)}/{total}] round {number}, {label}: {figures['tokens_per_s']:.2f} output tokens/s, "
                         f"{figures['max_running']} running at most, wall {figures['wall_s']:.0f} s "
                         f"(elapsed {elapsed:.0f} s, about {eta:.0f} s left)")
    summary = summarize(runs)
    return {"settings": {"requests": requests, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
                         "pool_tokens": bench.pool_tokens, "rounds": rounds, "second_threshold": threshold,
                         "configs": list(configs), "baseline": baseline, "engine_args": bench.engine,
                         "kvzap_overlap": kvzap_overlap,
                         **bench.provenance()},
            "dense_backend": dense, "runs": runs, "summary": summary, "vs_dense": compare(summary, runs, baseline)}
