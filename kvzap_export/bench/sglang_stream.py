"""SGLang at a fixed KV budget: dense vs KVzap's evict mode vs its ragged (per-head) mode, interleaved rounds.

Each run launches a real ``sglang.Engine`` (the engine environment's Python; ``integrations/sglang/driver``) with
the same KV budget (``--max-total-tokens``) and server flags, and submits the same stream of requests at once
(distinct prompts of ``prompt_tokens`` tokens, ``new_tokens`` greedy tokens each, ``ignore_eos``). Rounds
interleave the configurations (dense, evict, ragged[, ragged at a second threshold], ragged with KVzap off, dense,
...), so that a slow period of the machine hits every configuration alike; every figure is given as the median
over rounds with its spread (``stream_figures``). Dense is SGLang without KVzap (readings only) on the fastest
attention backend that runs here: each candidate serves a short probe stream first, and the faster one is the
baseline. "Ragged, KVzap off" is the ragged mode's storage and attention with every request asking for KVzap off:
it holds every entry, as dense does, so what it gains over dense is the implementation, and what ragged gains over
it is the memory KVzap freed. "Ragged at dense's concurrency" caps the ragged mode at the requests dense ran at
once in that round (``--max-running-requests``), so that its decode step is timed at dense's batch size.
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


def stream_prompts(tokenizer, count: int, tokens: int) -> list[list[int]]:
    """``count`` distinct prompts of ``tokens`` tokens from Python's own documentation (pydoc topics)."""
    from pydoc_data.topics import topics

    ids = tokenizer("\n\n".join(topics[k] for k in sorted(topics)))["input_ids"]
    if len(ids) < count * tokens:
        raise ValueError(f"not enough text for {count} prompts of {tokens} tokens")
    step = len(ids) // count
    return [ids[i * step: i * step + tokens] for i in range(count)]


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
                 new_tokens: int = 96, pool_tokens: int | None = None, engine: dict | None = None):
        from transformers import AutoTokenizer

        self.bundle, self.model, self.python = str(Path(bundle).absolute()), str(Path(model).absolute()), python
        self.requests, self.prompt_tokens, self.new_tokens = requests, prompt_tokens, new_tokens
        # 8 requests' worth: SGLang charges a request its prompt + max_new_tokens + 1 and admits while the next one is
        # strictly below what is left, so 8 * (prompt + new) would fit 7 and leave most of a request's room unused.
        self.pool_tokens = pool_tokens or 8 * (prompt_tokens + new_tokens + 2)
        self.prompts = stream_prompts(AutoTokenizer.from_pretrained(model), requests, prompt_tokens)
        self.engine = {"max_total_tokens": self.pool_tokens, "max_running_requests": requests,
                       "context_length": prompt_tokens + new_tokens + 16, **(engine or {})}

    def spec(self, mode: str, threshold: float | None = None, backend: str | None = None, requests: int | None = None,
             new_tokens: int | None = None, choice: str = "decoding", running: int | None = None) -> dict:
        prompts = self.prompts[: requests or self.requests]
        engine = dict(self.engine, **({"attention_backend": backend} if backend else {}))
        if running:
            engine["max_running_requests"] = running
        return {"model": self.model, "bundle": self.bundle, "mode": mode, "threshold": threshold, "engine": engine,
                "stream": [{"input_ids": p, "max_new_tokens": new_tokens or self.new_tokens, "kvzap": choice}
                           for p in prompts]}

    def provenance(self) -> dict:
        """What fixes the figures: the prompts (hash of their ids), the bundle's surrogate and pruning settings."""
        manifest = json.loads((Path(self.bundle) / "manifest.json").read_text())
        digest = hashlib.sha256(json.dumps(self.prompts).encode()).hexdigest()
        return {"prompts_sha256": digest, "prompt_source": "pydoc_data.topics of this Python",
                "surrogate": {k: manifest["surrogate"].get(k) for k in ("variant", "source", "sha256")},
                "pruning": manifest.get("pruning")}

    def probe_dense(self, candidates: tuple[str, ...], on_event=None) -> dict:
        """Each dense backend serves the first 8 requests with 32 new tokens; the faster is the baseline."""
        found = {}
        for backend in candidates:
            try:
                figures = run_figures(run_stream(self.python, self.spec("dense", backend=backend, requests=min(8, self.requests),
                                                                        new_tokens=min(32, self.new_tokens))))
                found[backend] = {"tokens_per_s": figures["tokens_per_s"], "wall_s": figures["wall_s"]}
            except RuntimeError as exc:
                found[backend] = {"error": str(exc).splitlines()[-1][:300]}
            if on_event:
                on_event(f"dense backend probe: {backend}: " + (f"{found[backend]['tokens_per_s']:.2f} tokens/s"
                                                                if "tokens_per_s" in found[backend] else "failed"))
        usable = {b: f for b, f in found.items() if "tokens_per_s" in f}
        if not usable:
            raise RuntimeError(f"no dense attention backend ran: {found}")
        return {"candidates": found, "chosen": max(usable, key=lambda b: usable[b]["tokens_per_s"]),
                "probe": {"requests": min(8, self.requests), "new_tokens": min(32, self.new_tokens)}}


def bench_sglang(bundle: str, model: str, python: str, requests: int = 32, prompt_tokens: int = 1024, new_tokens: int = 96,
                 pool_tokens: int | None = None, rounds: int = 3, threshold: float | None = None,
                 dense_backends: tuple[str, ...] = CPU_DENSE_BACKENDS, engine: dict | None = None,
                 on_event=None) -> dict:
    """Interleaved rounds of every configuration; returns the settings, each run's figures, the medians with
    spread per configuration and the comparisons with dense (``stream_figures.summarize`` / ``compare``)."""
    bench = StreamBench(bundle, model, python, requests, prompt_tokens, new_tokens, pool_tokens, engine)
    dense = (bench.probe_dense(dense_backends, on_event) if len(dense_backends) > 1
             else {"candidates": {}, "chosen": dense_backends[0], "probe": None})
    # (label, mode, threshold, attention backend, each request's custom_params kvzap, cap on running requests)
    configs = [("dense", "dense", None, dense["chosen"], "decoding", None), ("evict", "evict", None, None, "decoding", None),
               ("ragged", "ragged", None, None, "decoding", None)]
    if threshold is not None:
        configs.append((f"ragged τ={threshold:g}", "ragged", threshold, None, "decoding", None))
    # The ragged mode's storage and attention with nothing pruned: what the implementation alone does at dense memory.
    configs.append(("ragged, KVzap off", "ragged", None, None, "off", None))
    # The ragged mode held to the requests dense ran at once: its decode step next to dense's at the same batch.
    configs.append(("ragged at dense's concurrency", "ragged", None, None, "decoding", "dense"))
    runs, started = [], time.perf_counter()
    total = rounds * len(configs)
    for number in range(1, rounds + 1):
        dense_running = None
        for label, mode, tau, backend, choice, running in configs:
            cap = dense_running if running == "dense" else None
            if running == "dense" and not cap:
                raise ConfigError("'ragged at dense's concurrency' needs dense's most running requests of the round, "
                                  "but dense ran no decode step; give --new-tokens 2 or more")
            result = run_stream(python, bench.spec(mode, tau, backend, choice=choice, running=cap))
            figures = run_figures(result)
            if label == "dense":
                dense_running = figures["max_running"]
            runs.append({"round": number, "label": label, "mode": mode, "threshold": tau, "kvzap": choice,
                         "max_running_requests": result["engine"]["args"].get("max_running_requests"),
                         "attention_backend": result["engine"]["args"].get("attention_backend"), "figures": figures})
            if on_event:
                elapsed = time.perf_counter() - started
                eta = elapsed / len(runs) * (total - len(runs))
                on_event(f"[{len(runs)}/{total}] round {number}, {label}: {figures['tokens_per_s']:.2f} output tokens/s, "
                         f"{figures['max_running']} running at most, wall {figures['wall_s']:.0f} s "
                         f"(elapsed {elapsed:.0f} s, about {eta:.0f} s left)")
    summary = summarize(runs)
    return {"settings": {"requests": requests, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
                         "pool_tokens": bench.pool_tokens, "rounds": rounds, "second_threshold": threshold,
                         "engine_args": bench.engine, **bench.provenance()},
            "dense_backend": dense, "runs": runs, "summary": summary, "vs_dense": compare(summary, runs)}
