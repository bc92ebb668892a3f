"""``bench --engine sglang``: the engine stream benchmark (interleaved rounds), printed as tables or JSON."""

from __future__ import annotations

import datetime
import json

import click

from kvzap_export.errors import ConfigError
from kvzap_export.provenance import checkout_commit, command_line


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
        ("prompt tokens from the radix cache", "radix_hit_rate"), ("τ in effect (ragged readings)", "threshold_in_effect"),
        ("decode steps replaying a CUDA graph", "decode_graph_replays"), ("wall (s)", "wall_s"))
# What --engine-arg may not set: the benchmark sets it, per configuration or through an option of its own.
RESERVED = {"model_path": "--model", "load_format": "--load-format", "skip_tokenizer_init": "--load-format dummy",
            "max_total_tokens": "--pool-tokens", "max_running_requests": "--requests (and the ragged-at-dense cap)",
            "attention_backend": "--dense-backend (KVzap's modes set their own)", "disable_radix_cache": "--configs",
            "disable_overlap_schedule": "--kvzap-overlap / --dense-overlap", "tp_size": "--tp-size"}
PRUNING_RAGGED = ("ragged", "ragged-radix", "ragged-at-dense")  # the ragged configurations in which KVzap decides


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
    memory = {r["label"]: r.get("gpu_memory") for r in report["runs"] if r.get("gpu_memory")}
    if memory:  # a GPU engine: the device's memory in use at the stream's end (the last round's)
        figures.add_row("GPU GB in use at the end / SGLang's static plan",
                        *[f"{memory[label]['used_bytes'] / 1e9:.1f} / "
                          f"{(memory[label].get('mem_fraction_static') or 0) * memory[label]['total_bytes'] / 1e9:.1f}"
                          if label in memory else "–" for label in summary])
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


def engine_gpu_name(interpreter: str) -> str:
    """The GPU's name as the engine's Python sees it (asked in a child process: this one opens no CUDA context, which
    would hold GPU memory during the runs)."""
    import subprocess

    done = subprocess.run([interpreter, "-c", "import torch; print(torch.cuda.get_device_name(0))"], capture_output=True,
                          text=True, timeout=300)
    return done.stdout.strip() or "unknown GPU"


def check_fractions(fractions: tuple, threshold, chosen: tuple[str, ...]) -> None:
    if not fractions:
        return
    if threshold is not None:
        raise ConfigError(f"--pruned-fraction with --threshold {threshold:g}: both set τ; give one of them")
    if not set(PRUNING_RAGGED) & set(chosen):
        raise ConfigError(f"--pruned-fraction: no configuration in --configs prunes with KVzap's ragged mode; add one of "
                          f"{', '.join(PRUNING_RAGGED)}")
    if len(fractions) > 1 and "ragged" not in chosen:
        raise ConfigError("--pruned-fraction with several fractions: the further ones are runs beside 'ragged'; add "
                          "ragged to --configs")


def run_engine_bench(bundle, model, python, requests, prompt_tokens, new_tokens, pool_tokens, rounds, threshold,
                     dense_backend, as_json, configs: str | None = None, shared: int = 0,
                     kvzap_overlap: bool = True, device: str = "cpu", load_format: str = "auto",
                     pruned_fraction: str | None = None, dense_overlap: bool | None = None, engine_arg=(),
                     save_runs: str | None = None, tp_size: int = 1) -> None:
    from kvzap_export.bench.run import SCHEMA
    from kvzap_export.bench.sglang_stream import (CPU_DENSE_BACKENDS, DEFAULT_CONFIGS, GPU_DENSE_BACKENDS, baseline_of,
                                                  bench_sglang, check_shared_prefix, parse_configs, parse_fractions)
    from kvzap_export.bench.timing import machine
    from kvzap_export.cli.engine_args import parse_engine_args
    from kvzap_export.validate.engine_level import check_engine_gpu, engine_python

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
    fractions = parse_fractions(pruned_fraction)
    check_fractions(fractions, threshold, chosen)
    extra = parse_engine_args(engine_arg, RESERVED)
    if tp_size != 1:
        extra["tp_size"] = tp_size
    interpreter = engine_python(python)
    if device == "cuda":
        check_engine_gpu(interpreter)
    backends = ((GPU_DENSE_BACKENDS if device == "cuda" else CPU_DENSE_BACKENDS) if dense_backend == "auto"
                else (dense_backend,))
    count = len(chosen) + (threshold is not None and "ragged" in chosen) + ("ragged" in chosen) * len(fractions[1:])
    probes = len(backends) * (2 if dense_overlap is None else 1)
    say = lambda line: click.echo(line, err=True)  # noqa: E731  (stderr: --json's document goes to stdout)
    say(f"SGLang stream benchmark ({'GPU' if device == 'cuda' else 'CPU'} engine{', dummy weights' * (load_format == 'dummy')}): "
        f"{requests} requests x {prompt_tokens} prompt tokens"
        f"{f' ({shared} shared)' if shared else ''} x {new_tokens} new tokens, {rounds} interleaved rounds of {count} "
        f"configurations ({', '.join(chosen)}; {rounds * count} engine launches"
        f"{f', after a probe of dense settings ({probes} launches)' if probes > 1 else ''}); ratios against "
        f"{baseline_of(chosen)}; KVzap's configurations with SGLang's overlap scheduler {'on' if kvzap_overlap else 'off'}")
    if fractions:
        say(f"τ: set in each ragged launch from its first prompts' scores so that {', '.join(f'{f:.0%}' for f in fractions)} "
            "of them lie below it (KVZAP_PRUNED_FRACTION; the bundle's τ is not used)"
            + (": random weights give meaningless scores" if load_format == "dummy" else ""))
    if rounds == 1:
        say("one round: each figure is one run, not a median")
    name = engine_gpu_name(interpreter) if device == "cuda" else machine("cpu")
    on_run = None
    if save_runs:  # one JSON line per finished run, the settings first (a run cut short keeps what ran)
        def on_run(record: dict, path=save_runs) -> None:
            with open(path, "a") as handle:
                handle.write(json.dumps(record) + "\n")

        on_run({"settings": {"requests": requests, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
                             "pool_tokens": pool_tokens, "rounds": rounds, "pruned_fractions": list(fractions),
                             "configs": list(chosen), "load_format": load_format, "device": device}, "machine": name})
    result = bench_sglang(bundle, model, interpreter, requests, prompt_tokens, new_tokens, pool_tokens, rounds, threshold,
                          backends, engine=extra, on_event=say, configs=chosen, shared=shared, kvzap_overlap=kvzap_overlap,
                          pruned_fractions=fractions, load_format=load_format, device=device, dense_overlap=dense_overlap,
                          on_run=on_run)
    report = {"schema": SCHEMA, "machine": name, "device": device, "date": datetime.date.today().isoformat(),
              "command": command_line(), "commit": checkout_commit(), **result}
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        _print(report, kvzap_overlap)
    if report.get("errors"):
        from kvzap_export.errors import BenchFailedError

        raise BenchFailedError(f"bench --engine sglang: {len(report['errors'])} run(s) failed (the others' figures are "
                               "above): " + "; ".join(f"round {e['round']} {e['label']}: {e['error']}"
                                                      for e in report["errors"]))


def _print(report: dict, kvzap_overlap: bool) -> None:
    from rich.console import Console

    console = Console()
    dense = report["dense_backend"]
    console.print(f"{report['machine']} · {report['date']} · baseline: {report['settings']['baseline']}, SGLang's "
                  f"{dense['chosen']} backend, overlap scheduler {'on' if dense.get('overlap') else 'off'}; KVzap's "
                  f"configurations: overlap scheduler {'on' if kvzap_overlap else 'off'}")
    if report["summary"]:
        for table in _tables(report):
            console.print(table)
