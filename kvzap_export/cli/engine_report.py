"""``validate --engine``: runs the engine level, writes its report, prints the table or the JSON."""

from __future__ import annotations

import json
from pathlib import Path

import click


def run_engine_cli(bundle, engine, mode, model, prompts, new_tokens, python, device, quiet, as_json,
                   require: tuple[str, ...] = (), chunk_size: int | None = None, radix_cache: bool = True,
                   extra_engine_args: dict | None = None) -> None:
    from kvzap_export.bundle.manifest import read_manifest
    from kvzap_export.validate.engine_level import run_engine_level, write_engine_report

    bundle = Path(bundle)
    manifest = read_manifest(bundle)
    show = not (quiet or as_json)

    def on_line(text: str) -> None:
        if show:
            click.echo(f"  {engine} ({mode}): {text}", err=True)

    def on_start() -> None:
        if show:
            click.echo(f"engine level: starting {engine} ({mode} mode) with the kvzap plugin; this takes a minute", err=True)

    engine_args = {"chunked_prefill_size": chunk_size} if chunk_size else {}
    if not radix_cache:
        engine_args["disable_radix_cache"] = True
    engine_args.update(extra_engine_args or {})  # --engine-arg (keys distinct from the two above: validate_cmd.py)
    result = run_engine_level(bundle, manifest, engine, mode, model, prompts, new_tokens, python, device, on_line=on_line,
                              on_start=on_start, engine_args=engine_args or None)
    report = write_engine_report(bundle, result)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    elif not quiet:
        click.echo(report.read_text(), err=True)
    # The engine level's result goes through the same three-state verdict as every other level.
    from kvzap_export.validate.checks import Check, not_run, required_checks, verdict, verdict_error

    status = result["status"] if result["status"] in ("passed", "failed") else "skipped"
    checks = [Check(f"engine:{engine}:{mode}", "engine", status,
                    {**result, "reason": result.get("reason", result.get("summary", ""))})]
    checks += required_checks(checks, require)  # --require engine: not run is a failure
    state = verdict(checks)
    error = verdict_error({"verdict": state, "failed": [c.name for c in checks if c.status == "failed"],
                           "not_run": not_run(checks)}, str(report))
    if error is not None:
        raise error
