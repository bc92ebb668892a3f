"""``bench --engine sglang``: the engine stream benchmark (interleaved rounds), printed as tables or JSON."""

from __future__ import annotations

import datetime
import json

import click


def _fmt(spread: dict, digits: int = 3) -> str:
    """median [min–max] of the rounds."""
    if spread["median"] is None:
        return "–"
    value = lambda v: f"{v:.{digits}g}"  # noqa: E731
    if spread["n"] < 2 or spread["min"] == spread["max"]:
        return value(spread["median"])
    return f"{value(spread['median'])} [{value(spread['min'])}–{value(spread['max'])}]"


ROWS = (("output tokens/s (whole stream)", "tokens_per_s"), ("requests/s", "requests_per_s"),
        ("TTFT p50 / p90 (s)", ("ttft_p50_s", "ttft_p90_s")), ("inter-token p50 / p90 (s)", ("itl_p50_s", "itl_p90_s")),
        ("most running at once", "max_running"), ("K/V entries after a prompt", "kv_held_after_prefill"),
        ("K/V entries at the peak", "kv_peak_entries"), ("freed at each request's peak", "freed_at_peak"),
        ("prefill s per 1k prompt tokens computed", "prefill_s_per_1k_tokens"),
        ("prompt tokens from the radix cache", "radix_hit_rate"), ("wall (s)", "wall_s"))


def _tables(report: dict):
    """Two tables, configurations as columns: the figures (median [min–max] over rounds), then the ratios."""
    from rich.table import Table

    summary, versus = report["summary"], report["vs_dense"]
    figures = Table(title="SGLang stream: medians over rounds [min–max]")
    figures.add_column("figure")
    for label in summary:
        figures.add_column(label, overflow="fold")
    for name, key in ROWS:
        keys = key if isinstance(key, tuple) else (key,)
        figures.add_row(name, *[" / ".join(_fmt(entry[k]) for k in keys) for entry in summary.values()])
    figures.add_row("MB allocated (every buffer)", *[f"{sum(e['bytes'].values()) / 1e6:.1f}" for e in summary.values()])
    ratios = Table(title=f"against {report['settings'].get('baseline', 'dense')} (medians)")
    ratios.add_column("figure")
    for label in versus:
        ratios.add_column(label, overflow="fold")
    fmt = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
    for name, key in (("output tokens/s", "tokens_per_s_ratio"), ("running at once", "running_ratio"),
                      ("running predicted, 1 / (1 - freed)", "running_ratio_predicted"),
                      ("running / predicted", "running_vs_predicted"), ("prefill time", "prefill_ratio")):
        ratios.add_row(name, *[fmt(c[key]) for c in versus.values()])
    ratios.add_row("decode step at equal batch", *[", ".join(f"{n}: {r:.2f}" for n, r in
                                                             c["decode_step_ratio_at_equal_batch"].items()) or "–"
                                                   for c in versus.values()])
    return figures, ratios


def run_engine_bench(bundle, model, python, requests, prompt_tokens, new_tokens, pool_tokens, rounds, threshold,
                     dense_backend, as_json, configs: str | None = None, shared: int = 0,
                     kvzap_overlap: bool = True) -> None:
    from kvzap_export.bench.run import SCHEMA
    from kvzap_export.bench.sglang_stream import (CPU_DENSE_BACKENDS, DEFAULT_CONFIGS, baseline_of, bench_sglang,
                                                  check_shared_prefix, parse_configs)
    from kvzap_export.bench.timing import machine
    from kvzap_export.errors import ConfigError
    from kvzap_export.validate.engine_level import engine_python

    if not bundle or not model:
        raise ConfigError("bench --engine sglang needs --bundle BUNDLE and --model DIR (kvzap-export export-model ...)")
    for name, value in (("--requests", requests), ("--prompt-tokens", prompt_tokens), ("--new-tokens", new_tokens),
                        ("--rounds", rounds)):
        if value < 1:
            raise ConfigError(f"{name} {value}: must be a positive integer")
    configs = configs or ",".join(DEFAULT_CONFIGS)
    chosen = parse_configs(configs)
    check_shared_prefix(shared, prompt_tokens)
    if shared and "dense-radix" not in chosen:
        raise ConfigError(f"--shared-prefix-tokens {shared} with --configs {configs}: add dense-radix (prompts that share "
                          "a prefix are served best by dense SGLang with its radix cache: the baseline to beat)")
    if new_tokens < 2:
        raise ConfigError(f"--new-tokens {new_tokens}: must be at least 2 (the first token comes from the prefill; "
                          "the benchmark compares decode steps)")
    interpreter = engine_python(python)
    backends = CPU_DENSE_BACKENDS if dense_backend == "auto" else (dense_backend,)
    count = len(chosen) + (threshold is not None and "ragged" in chosen)
    say = lambda line: click.echo(line, err=True)  # noqa: E731  (stderr: --json's document goes to stdout)
    say(f"SGLang stream benchmark: {requests} requests x {prompt_tokens} prompt tokens"
        f"{f' ({shared} shared)' if shared else ''} x {new_tokens} new tokens, {rounds} interleaved rounds of {count} "
        f"configurations ({', '.join(chosen)}; {rounds * count} engine launches"
        f", after a probe of dense's {len(backends) * 2} settings); ratios against {baseline_of(chosen)}; KVzap's "
        f"configurations with SGLang's overlap scheduler {'on' if kvzap_overlap else 'off'}")
    result = bench_sglang(bundle, model, interpreter, requests, prompt_tokens, new_tokens, pool_tokens, rounds, threshold,
                          backends, on_event=say, configs=chosen, shared=shared, kvzap_overlap=kvzap_overlap)
    report = {"schema": SCHEMA, "machine": machine("cpu"), "device": "cpu", "date": datetime.date.today().isoformat(),
              "command": "kvzap-export bench --engine sglang", **result}
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    from rich.console import Console

    console = Console()
    dense = report["dense_backend"]
    console.print(f"{report['machine']} · {report['date']} · baseline: {report['settings']['baseline']}, SGLang's "
                  f"{dense['chosen']} backend, overlap scheduler {'on' if dense.get('overlap') else 'off'}; KVzap's "
                  f"configurations: overlap scheduler {'on' if kvzap_overlap else 'off'}")
    for table in _tables(report):
        console.print(table)
