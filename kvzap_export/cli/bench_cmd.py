"""``kvzap-export bench``: what KVzap costs next to attention, and what it frees."""

from __future__ import annotations

import json

import click

from kvzap_export.bench.sglang_stream import DEFAULT_CONFIGS
from kvzap_export.cli.engine_args import HELP as ENGINE_ARG_HELP

SUITES = ("scoring", "compaction", "overhead", "e2e")


def _fmt(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _table(title: str, rows: list[dict]):
    """Columns that vary between rows; the ones every row shares go in the caption."""
    from rich.table import Table

    keys = [k for k in dict.fromkeys(k for row in rows for k in row) if k != "benchmark"]
    shared = [k for k in keys if all(k in row for row in rows) and len({_fmt(row[k]) for row in rows}) == 1]
    varying = [k for k in keys if k not in shared]
    caption = ", ".join(f"{k} {_fmt(rows[0][k])}" for k in shared) if len(rows) > 1 else None
    table = Table(title=title, caption=caption)
    for key in (varying if len(rows) > 1 else keys):
        table.add_column(key, overflow="fold")
    for row in rows:
        table.add_row(*[_fmt(row.get(k, "")) for k in (varying if len(rows) > 1 else keys)])
    return table


@click.command()
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the suites run; with --engine, where the engine runs (cuda: SGLang's CUDA engine, bf16, its "
                   "CUDA attention backends for the dense baseline; the engine's Python must see the GPU).")
@click.option("--only", default=",".join(SUITES), show_default=True, help="Comma-separated suites to run.")
@click.option("--engine", type=click.Choice(["sglang"]), default=None,
              help="Instead of the suites: a serving engine at a fixed KV budget, dense vs KVzap's evict and ragged "
                   "modes in interleaved rounds, one stream of requests each (needs --bundle, --model and the "
                   "engine's Python).")
@click.option("--bundle", default=None, type=click.Path(), help="With --engine: the KVzap bundle.")
@click.option("--model", default=None, type=click.Path(), help="With --engine: the HF model directory the engine serves.")
@click.option("--engine-python", default=None, envvar="KVZAP_SGLANG_PYTHON", metavar="PATH",
              help="With --engine: the engine environment's Python (default $KVZAP_SGLANG_PYTHON).")
@click.option("--requests", default=32, show_default=True, type=int, help="With --engine: requests in the stream.")
@click.option("--prompt-tokens", default=1024, show_default=True, type=int, help="With --engine: tokens per prompt.")
@click.option("--new-tokens", default=96, show_default=True, type=int, help="With --engine: greedy tokens per request.")
@click.option("--pool-tokens", default=None, type=int,
              help="With --engine: the KV budget in dense tokens (--max-total-tokens); default 8 requests' worth "
                   "(8 x (prompt + new + 2): dense SGLang runs 8 at once).")
@click.option("--rounds", default=3, show_default=True, type=int,
              help="With --engine: interleaved rounds (dense, evict, ragged, ...); figures are medians over them.")
@click.option("--threshold", default=None, type=float,
              help="With --engine: also run ragged mode at this second threshold τ (a harsher one prunes more).")
@click.option("--dense-backend", default="auto", show_default=True,
              help="With --engine: SGLang's attention backend for the dense baseline; 'auto' probes torch_native and "
                   "flex_attention on a short stream and keeps the faster.")
@click.option("--configs", default=",".join(DEFAULT_CONFIGS), show_default=True,
              help="With --engine: the configurations to run, comma-separated: dense, dense-radix (SGLang without "
                   "KVzap, radix cache off / on), evict, ragged, ragged-off (ragged storage, KVzap off: KVzap's own "
                   "share), ragged-radix, ragged-radix-off (the same two with SGLang's radix cache on: prompts' "
                   "per-head entries shared exactly), ragged-at-dense (ragged capped at the baseline's concurrency; "
                   "the ragged configurations without 'radix' run the radix cache off). Ratios are taken against "
                   "dense-radix when chosen, else dense.")
@click.option("--shared-prefix-tokens", default=0, show_default=True, type=int,
              help="With --engine: the first N tokens of every prompt are the same (a shared system prompt), the "
                   "rest distinct; needs dense-radix in --configs (the baseline that prefills the prefix once).")
@click.option("--kvzap-overlap", type=click.Choice(["on", "off"]), default="on", show_default=True,
              help="With --engine: SGLang's overlap scheduler in KVzap's configurations (on: SGLang's default; the "
                   "dense baseline takes the faster of off and on from its probe). On a CPU engine it gains nothing; "
                   "with it on, ragged mode holds a request that shares a prefix with the prefill in flight for one "
                   "batch, so that it hits that prefill's prompt in the radix cache.")
@click.option("--load-format", type=click.Choice(["auto", "dummy"]), default="auto", show_default=True,
              help="With --engine: dummy = SGLang builds the model from --model's config.json with random weights (no "
                   "weights or tokenizer needed: Llama-3.1-8B's shapes from its config alone); the prompts are then "
                   "seeded random token ids and the engine skips its tokenizer. Random weights give meaningless "
                   "scores: set τ with --pruned-fraction.")
@click.option("--pruned-fraction", default=None, metavar="F[,F2...]",
              help="With --engine: τ set in each ragged-mode launch from its first prompts' scores so that fraction F "
                   "of them lies below it (KVZAP_PRUNED_FRACTION, logged; the bundle's τ is not used); each further F2 "
                   "adds a ragged run at F2. For models whose scores mean nothing (--load-format dummy). Exclusive with "
                   "--threshold.")
@click.option("--dense-overlap", type=click.Choice(["probe", "on", "off"]), default="probe", show_default=True,
              help="With --engine: SGLang's overlap scheduler in the dense runs: probe (the faster of off and on, from "
                   "short probe runs) or fixed; with one --dense-backend and a fixed setting no probe runs.")
@click.option("--engine-arg", "engine_arg", multiple=True, metavar="KEY=VALUE",
              help="With --engine: " + ENGINE_ARG_HELP + " Applies to every launch. The benchmark sets the model, the "
                   "load format, the KV budget, the running cap, attention backends, the radix cache and the overlap "
                   "scheduler through its own options. On a GPU without flashinfer: --engine-arg sampling_backend=pytorch.")
@click.option("--tp-size", default=1, show_default=True, type=click.IntRange(min=1), metavar="N",
              help="With --engine: SGLang's tensor parallelism (its --tp-size) in every launch; steps are timed from "
                   "rank 0's readings (every rank runs them), memory figures summed over the ranks (each holds its own "
                   "KV heads). On the CPU engine the ranks split this machine's cores.")
@click.option("--save-runs", default=None, type=click.Path(), metavar="FILE",
              help="With --engine: append the settings, then each run's record (or error) as a JSON line to FILE as soon "
                   "as it is done, so that a benchmark cut short keeps what ran.")
@click.option("--with-compile", is_flag=True,
              help="Also time torch.compile'd scoring (minutes of compilation; the engines do not use it: it measured "
                   "slower than eager on an H100).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON (schema kvzap-export-bench/1).")
def bench(device: str, only: str, engine, bundle, model, engine_python, requests, prompt_tokens, new_tokens, pool_tokens,
          rounds, threshold, dense_backend, configs, shared_prefix_tokens, kvzap_overlap, load_format, pruned_fraction,
          dense_overlap, engine_arg, tp_size, save_runs, with_compile: bool, as_json: bool) -> None:
    """Benchmark KVzap: surrogate scoring (the engines' eager path, on a GPU also inside a CUDA graph; ONNX
    Runtime on a CPU), threshold compaction at 4k/32k/128k tokens (on a GPU the fused Triton and CUDA kernels as
    engines launch them), overhead vs one attention block at the model's dtype (Llama-3.1-8B shapes; at decode
    the per-step decision, eager and graphed), and end to end on the embedded model (kvpress masking vs our
    physically compacted cache). Ratios come from one run. Parts this machine lacks (a GPU, nvcc,
    onnxruntime-extensions, kvpress, the model) skip their rows with the reason.

    \b
    --engine sglang: SGLang at one KV budget, dense (its fastest attention backend here) vs evict vs ragged,
    interleaved rounds: output tokens/s and requests/s over the whole stream, TTFT and inter-token latency
    p50/p90, most requests running at once, K/V held after a prompt and at the peak, memory freed at each
    request's peak, bytes of every buffer, decode step per batch size, prefill time; medians [min-max] over
    rounds, ratios against dense (read from the scheduler's own step ends). --shared-prefix-tokens N: prompts that
    share their first N tokens, the radix cache's hit rate reported, against dense with the radix cache on.
    """
    if engine is not None:
        from kvzap_export.cli.engine_bench import run_engine_bench

        run_engine_bench(bundle, model, engine_python, requests, prompt_tokens, new_tokens, pool_tokens, rounds, threshold,
                         dense_backend, as_json, configs, shared_prefix_tokens, kvzap_overlap == "on", device=device,
                         load_format=load_format, pruned_fraction=pruned_fraction,
                         dense_overlap={"probe": None, "on": True, "off": False}[dense_overlap], engine_arg=engine_arg,
                         save_runs=save_runs, tp_size=tp_size)
        return
    from kvzap_export.errors import ConfigError

    given = [name for name, value in (("--load-format", load_format != "auto"), ("--pruned-fraction", pruned_fraction),
                                      ("--dense-overlap", dense_overlap != "probe"), ("--engine-arg", engine_arg),
                                      ("--save-runs", save_runs), ("--tp-size", tp_size != 1)) if value]
    if given:
        raise ConfigError(f"{given[0]}: it sets the engine benchmark; add --engine sglang")
    import torch

    from kvzap_export.bench.run import run_bench
    from kvzap_export.cli.progress import progress_bars

    chosen = tuple(s.strip() for s in only.split(",") if s.strip())
    unknown = [s for s in chosen if s not in SUITES]
    if unknown or not chosen:
        raise ConfigError(f"--only {only!r}: unknown suite(s) {unknown}; choose from {', '.join(SUITES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA GPU is visible to torch; use --device cpu")
    with progress_bars(enabled=not as_json) as progress:
        report = run_bench(device, chosen, progress=progress, compile_scoring=with_compile)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        from rich.console import Console

        console = Console()
        console.print(f"{report['machine']} · {report['device']} · {report['date']} · torch {report['torch']}")
        for name, rows in report["results"].items():
            console.print(_table(name, rows))
    if report["errors"]:
        from kvzap_export.errors import BenchFailedError

        raise BenchFailedError(f"bench: suite(s) {', '.join(report['errors'])} raised (the other suites' figures are "
                               "above): " + "; ".join(row["error"] for name in report["errors"] for row in report["results"][name]))
