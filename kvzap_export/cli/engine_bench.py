"""``bench --engine sglang``: the engine stream benchmark, printed as a table or JSON."""

from __future__ import annotations

import datetime
import json

import click


def run_engine_bench(bundle, model, python, requests, prompt_tokens, new_tokens, pool_tokens, as_json) -> None:
    from kvzap_export.bench.run import SCHEMA
    from kvzap_export.bench.sglang_stream import bench_sglang
    from kvzap_export.bench.timing import machine
    from kvzap_export.errors import ConfigError
    from kvzap_export.validate.engine_level import engine_python

    if not bundle or not model:
        raise ConfigError("bench --engine sglang needs --bundle BUNDLE and --model DIR (kvzap-export export-model ...)")
    for name, value in (("--requests", requests), ("--prompt-tokens", prompt_tokens), ("--new-tokens", new_tokens)):
        if value < 1:
            raise ConfigError(f"{name} {value}: must be a positive integer")
    interpreter = engine_python(python)

    def on_mode(row: dict) -> None:
        if not as_json:
            click.echo(f"  {row['mode']}: {row['max_running']} running at once, {row['tokens_per_s_at_saturation'] or 0:.2f} "
                       "tokens/s at saturation", err=True)

    if not as_json:
        click.echo(f"SGLang stream benchmark: {requests} requests x {prompt_tokens} tokens, 3 engine launches", err=True)
    rows = bench_sglang(bundle, model, interpreter, requests, prompt_tokens, new_tokens, pool_tokens, on_mode=on_mode)
    report = {"schema": SCHEMA, "machine": machine("cpu"), "device": "cpu", "date": datetime.date.today().isoformat(),
              "command": "kvzap-export bench --engine sglang", "results": {"sglang_stream": rows}}
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    from rich.console import Console

    from kvzap_export.cli.bench_cmd import _table

    console = Console()
    console.print(f"{report['machine']} · {report['date']}")
    console.print(_table("sglang_stream", rows))
