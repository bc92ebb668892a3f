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

On a GPU engine (``device="cuda"``) the driver runs without ``SGLANG_USE_CPU_ENGINE`` and bf16 (the driver's default
there). With ``load_format="dummy"`` SGLang builds the model from its config with random weights: the prompts are then
seeded random token ids (text means nothing to such a model; the directory needs no tokenizer, and the engine starts
with ``skip_tokenizer_init``), and since random weights give meaningless scores, ``pruned_fractions`` set τ instead of
the bundle's: each ragged-mode launch gets ``KVZAP_PRUNED_FRACTION`` (the plugin sets τ once, from the first prompts'
scores, so that this fraction of them lies below it, and logs it; the readings carry the τ in effect); the first fraction
is the ragged configurations', each further one adds a ragged run at it (labels "..., 70% pruned"). "Ragged, KVzap off"
gets the first fraction too, where it does nothing (no request asks KVzap to decide).
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
GPU_DENSE_BACKENDS = ("triton", "fa3", "flashinfer")  # SGLang's CUDA attention backends ('auto' probes them)
LOAD_FORMATS = ("auto", "dummy")


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


def model_vocabulary(model: str) -> tuple[int, set[int]]:
    """The vocabulary size and the special token ids (bos, eos, pad) of a model directory's config.json."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model {model}: no readable config.json ({exc})") from None
    config = config.get("text_config", config)
    if not isinstance(config.get("vocab_size"), int) or config["vocab_size"] < 2:
        raise ConfigError(f"--model {model}: its config.json gives no vocab_size to draw random prompts from")
    special = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(key)
        special.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    return config["vocab_size"], special


def random_prompts(vocab_size: int, count: int, tokens: int, shared: int = 0, avoid: set[int] = frozenset(),
                   seed: int = 0) -> list[list[int]]:
    """``count`` prompts of ``tokens`` seeded random token ids in ``[0, vocab_size)`` less ``avoid`` (special tokens);
    the first ``shared`` the same in every prompt (a model with random weights: ``load_format="dummy"``)."""
    import random

    check_shared_prefix(shared, tokens)
    rng = random.Random(seed)

    def draw() -> int:
        while True:
            token = rng.randrange(vocab_size)
            if token not in avoid:
                return token

    prefix = [draw() for _ in range(shared)]
    return [prefix + [draw() for _ in range(tokens - shared)] for _ in range(count)]


def parse_fractions(text: str | None) -> tuple[float, ...]:
    """``--pruned-fraction 0.7[,0.4...]``: fractions strictly between 0 and 1, distinct."""
    if text is None:
        return ()
    try:
        values = tuple(dict.fromkeys(float(v) for v in text.split(",") if v.strip()))
    except ValueError:
        values = ()
    if not values or not all(0.0 < v < 1.0 for v in values):
        raise ConfigError(f"--pruned-fraction {text!r}: use fractions strictly between 0 and 1, comma-separated (e.g. 0.7,0.4)")
    return values


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


def launch_env(device: str = "cpu", env: dict | None = None) -> dict:
    """The driver's environment: this one; on the CPU engine ``SGLANG_USE_CPU_ENGINE=1`` unless set, on a GPU without
    it; ``KVZAP_PRUNED_FRACTION`` only where ``env`` gives it (the plugin refuses it outside ragged mode)."""
    out = {k: v for k, v in os.environ.items() if k != "KVZAP_PRUNED_FRACTION"}
    if device == "cpu":
        out["SGLANG_USE_CPU_ENGINE"] = os.environ.get("SGLANG_USE_CPU_ENGINE", "1")
    else:
        out.pop("SGLANG_USE_CPU_ENGINE", None)
    return {**out, **(env or {})}


def run_stream(python: str, spec: dict, device: str = "cpu", env: dict | None = None) -> dict:
    """One engine launch serving ``spec``'s stream (the driver's result); ``env`` added to the driver's environment."""
    with tempfile.TemporaryDirectory(prefix="kvzap-bench-sglang-") as tmp:
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        done = subprocess.run([python, "-m", "kvzap_export.integrations.sglang.driver", str(Path(tmp) / "spec.json"),
                               str(Path(tmp) / "out.json")], capture_output=True, text=True, env=launch_env(device, env))
        if done.returncode != 0:
            raise RuntimeError(f"SGLang {spec['mode']} run failed:\n{done.stderr[-3000:]}")
        return json.loads((Path(tmp) / "out.json").read_text())


class StreamBench:
    """The benchmark's settings and the runs it made (see the module docstring)."""

    def __init__(self, bundle: str, model: str, python: str, requests: int = 32, prompt_tokens: int = 1024,
                 new_tokens: int = 96, pool_tokens: int | None = None, engine: dict | None = None, shared: int = 0,
                 load_format: str = "auto", device: str = "cpu"):
        self.bundle, self.model, self.python = str(Path(bundle).absolute()), str(Path(model).absolute()), python
        self.load_format, self.device = load_format, device
        self.requests, self.prompt_tokens, self.new_tokens = requests, prompt_tokens, new_tokens
        # 8 requests' worth: SGLang charges a request its prompt + max_new_tokens + 1 and admits while the next one is
        # strictly below what is left, so 8 * (prompt + new) would fit 7 and leave most of a request's room unused.
        self.pool_tokens = pool_tokens or 8 * (prompt_tokens + new_tokens + 2)
        self.shared = shared
        self.engine = {"max_total_tokens": self.pool_tokens, "max_running_requests": requests,
                       "context_length": prompt_tokens + new_tokens + 16}
        if load_format == "dummy":  # random weights: random ids, no tokenizer (module docstring)
            vocab, special = model_vocabulary(model)
            self.prompts = random_prompts(vocab, requests, prompt_tokens, shared, special)
            self.engine.update(load_format="dummy", skip_tokenizer_init=True)
        else:
            from transformers import AutoTokenizer

            self.prompts = stream_prompts(AutoTokenizer.from_pretrained(model), requests, prompt_tokens, shared)
        self.engine.update(engine or {})

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
        source = ("seeded random token ids (--load-format dummy: random weights)" if self.load_format == "dummy"
                  else "pydoc_data.topics of this Python")
        return {"prompts_sha256": digest, "prompt_source": source,
                "shared_prefix_tokens": self.shared,
                "surrogate": {k: manifest["surrogate"].get(k) for k in ("variant", "source", "sha256")},
                "pruning": manifest.get("pruning")}

    def probe_dense(self, candidates: tuple[str, ...], on_event=None, radix: bool = False,
                    overlaps: tuple[bool, ...] = (False, True)) -> dict:
        """Each dense backend, with SGLang's overlap scheduler off and on (its default, which ragged mode keeps; or as
        ``overlaps`` fixes it), serves the first 8 requests with 32 new tokens, with the radix cache as the baseline
        runs it (``radix``: the baseline is "dense, radix", and the 8 prompts share the workload's prefix); the
        fastest setting is the baseline's. One backend and one overlap setting: nothing to probe, nothing runs."""
        if len(candidates) == 1 and len(overlaps) == 1:
            return {"candidates": {}, "chosen": candidates[0], "overlap": overlaps[0], "probe": None}
        found = {}
        for backend in candidates:
            for overlap in overlaps:
                name = f"{backend}, overlap {'on' if overlap else 'off'}"
                spec = self.spec("dense", backend=backend, requests=min(8, self.requests),
                                 new_tokens=min(32, self.new_tokens), overlap=overlap, radix=radix)
                try:
                    figures = run_figures(run_stream(self.python, spec, device=self.device))
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
                 kvzap_overlap: bool = True, pruned_fractions: tuple[float, ...] = (), load_format: str = "auto",
                 device: str = "cpu", dense_overlap: bool | None = None, on_run=None) -> dict:
    """Interleaved rounds of every configuration; returns the settings, each run's figures, the medians with
    spread per configuration and the comparisons with the baseline (``stream_figures.summarize`` / ``compare``), and
    ``errors``: the runs whose launch failed (the others ran; no comparison without the baseline).
    ``dense_overlap``: the dense runs' overlap scheduler, fixed (None: the probe's choice). ``on_run(record)``: each run's
    record (or error) as soon as it is done (a benchmark cut short keeps what ran)."""
    if threshold is not None and pruned_fractions:
        raise ConfigError("--threshold and --pruned-fraction both set τ of a second ragged run; give one of them")
    bench = StreamBench(bundle, model, python, requests, prompt_tokens, new_tokens, pool_tokens, engine, shared,
                        load_format=load_format, device=device)
    baseline = baseline_of(configs)
    dense = bench.probe_dense(dense_backends, on_event, radix=baseline == CONFIGS["dense-radix"][0],
                              overlaps=(False, True) if dense_overlap is None else (dense_overlap,))
    # (label, mode, threshold, attention backend, each request's custom_params kvzap, radix cache, cap on running,
    # pruned fraction); the dense configurations take the probe's overlap setting, KVzap's SGLang's default (on: None
    # leaves it to the driver) unless kvzap_overlap is False
    kvzap_overlap_arg = None if kvzap_overlap else False
    first = pruned_fractions[0] if pruned_fractions else None
    plan = []
    for key in configs:
        label, mode, choice, radix, running = CONFIGS[key]
        prunes = mode == "ragged" and choice == "decoding"
        if first is not None and prunes:
            label = f"{label}, {first:.0%} pruned"
        plan.append((label, mode, None, dense["chosen"] if mode == "dense" else None, choice, radix, running,
                     first if mode == "ragged" else None))
        if key == "ragged" and threshold is not None:
            plan.append((f"ragged τ={threshold:g}", "ragged", threshold, None, "decoding", False, None, None))
        if key == "ragged":
            plan += [(f"ragged, {f:.0%} pruned", "ragged", None, None, "decoding", False, None, f)
                     for f in pruned_fractions[1:]]
    # a run capped at the baseline's concurrency needs the baseline's run of its round first
    plan.sort(key=lambda c: c[6] == "baseline")
    runs, errors, started = [], [], time.perf_counter()
    total = rounds * len(plan)
    for number in range(1, rounds + 1):
        base_running, base_failed = None, False
        for label, mode, tau, backend, choice, radix, running, fraction in plan:
            cap = base_running if running == "baseline" else None
            if running == "baseline" and base_failed:
                errors.append({"round": number, "label": label, "error": f"not run: {baseline}'s run of the round failed"})
                continue
            if running == "baseline" and not cap:
                raise ConfigError(f"'ragged at dense's concurrency' needs {baseline}'s most running requests of the round, "
                                  "but it ran no decode step; give --new-tokens 2 or more")
            spec = bench.spec(mode, tau, backend, choice=choice, running=cap, radix=radix,
                              overlap=dense["overlap"] if mode == "dense" else kvzap_overlap_arg)
            env = {"KVZAP_PRUNED_FRACTION": str(fraction)} if fraction is not None else None
            try:  # a launch that fails is recorded and the others still run (their figures are worth having)
                result = run_stream(python, spec, device=device, env=env)
                figures = run_figures(result)
            except (RuntimeError, ValueError) as exc:
                lines = [line for line in str(exc).splitlines() if line.strip()]
                errors.append({"round": number, "label": label, "error": (lines or ["no message"])[-1][:500],
                               "log_tail": str(exc)[-3000:]})
                base_failed = base_failed or label == baseline
                if on_run:
                    on_run(errors[-1])
                if on_event:
                    on_event(f"round {number}, {label}: FAILED: {errors[-1]['error']}")
                continue
            if label == baseline:
                base_running = figures["max_running"]
            args = result["engine"]["args"]
            runs.append({"round": number, "label": label, "mode": mode, "threshold": tau, "kvzap": choice,
                         "pruned_fraction": fraction, "radix_cache": not args.get("disable_radix_cache", False),
                         "overlap_schedule": not args.get("disable_overlap_schedule", False),
                         "sglang_resolved": result["engine"].get("resolved", {}),
                         "max_running_requests": args.get("max_running_requests"),
                         "attention_backend": args.get("attention_backend"), "gpu_memory": result.get("gpu_memory"),
                         "figures": figures})
            if on_run:
                on_run(runs[-1])
            if on_event:
                elapsed = time.perf_counter() - started
                eta = elapsed / len(runs) * (total - len(runs))
                on_event(f"[{len(runs)}/{total}] round {number}, {label}: {figures['tokens_per_s']:.2f} output tokens/s, "
                         f"{figures['max_running']} running at most, wall {figures['wall_s']:.0f} s "
                         f"(elapsed {elapsed:.0f} s, about {eta:.0f} s left)")
    summary = summarize(runs)
    versus = compare(summary, runs, baseline) if baseline in summary else {}
    return {"settings": {"requests": requests, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
                         "pool_tokens": bench.pool_tokens, "rounds": rounds, "second_threshold": threshold,
                         "pruned_fractions": list(pruned_fractions), "load_format": load_format, "device": device,
                         "configs": list(configs), "baseline": baseline, "engine_args": bench.engine,
                         "kvzap_overlap": kvzap_overlap, "dense_overlap": dense_overlap,
                         **bench.provenance()},
            "dense_backend": dense, "runs": runs, "summary": summary, "vs_dense": versus, "errors": errors}
