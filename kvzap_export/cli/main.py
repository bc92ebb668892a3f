"""The ``kvzap-export`` command line.

Subcommands are loaded lazily (``--help`` does not import torch); the bare
``kvzap-export --model M --out DIR`` runs the whole pipeline. User errors (``KvzapError``)
print one line and exit 2 (a failed validation exits 1, an incomplete one 3); anything else is a bug and keeps
its traceback (exit 1).
"""

from __future__ import annotations

import importlib
import sys

import click

from kvzap_export import __version__, interrupts
from kvzap_export.errors import KvzapError

# name -> "module:attribute" of a click command; imported only when that command runs.
COMMANDS: dict[str, str] = {
    "bench": "kvzap_export.cli.bench_cmd:bench",
    "build": "kvzap_export.cli.build_cmd:build",
    "evaluate": "kvzap_export.cli.evaluate_cmd:evaluate",
    "export": "kvzap_export.cli.export_cmd:export",
    "export-model": "kvzap_export.cli.export_model_cmd:export_model",
    "inspect": "kvzap_export.cli.bundle_cmd:inspect",
    "presets": "kvzap_export.cli.presets_cmd:presets",
    "train": "kvzap_export.cli.train_cmd:train",
    "validate": "kvzap_export.cli.validate_cmd:validate",
    "verify": "kvzap_export.cli.bundle_cmd:verify",
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


def _pipeline_options(func):
    from kvzap_export.cli.options import pipeline_options

    return pipeline_options(func)


@click.group(cls=LazyGroup, invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@_pipeline_options
@click.version_option(__version__, prog_name="kvzap-export")
@click.pass_context
def cli(ctx: click.Context, **options) -> None:
    """Export KVzap KV-cache pruning to ONNX / TensorRT and prove parity with PyTorch.

    \b
    The bare command runs the whole pipeline into a bundle directory:
      kvzap-export --model smollm2-135m --out engine/
    Stages are also subcommands (see below); `kvzap-export COMMAND --help` explains each.
    """
    if ctx.invoked_subcommand is not None:
        return
    if options.get("model") is None and options.get("out") is None:
        click.echo(ctx.get_help())  # the bare `kvzap-export`: what it can do
        return
    if options.get("model") is None or options.get("out") is None:
        missing = "--out" if options.get("out") is None else "--model"
        raise click.UsageError(f"missing {missing}: the pipeline needs both --model and --out", ctx=ctx)
    from kvzap_export.cli.export_cmd import run_pipeline_from_cli

    run_pipeline_from_cli(**options)


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the process exit code."""
    with interrupts.remembered():
        return _run(argv)


def _run(argv: list[str] | None) -> int:
    try:
        try:
            cli.main(args=argv, prog_name="kvzap-export", standalone_mode=False)
        except Exception:
            if interrupts.interrupted():  # an error raised while a library handled the interrupt: the interrupt
                raise KeyboardInterrupt from None
            raise
    except KvzapError as exc:
        click.echo(f"{exc.label}: {exc}", err=True)
        return exc.exit_code
    except (click.exceptions.Abort, KeyboardInterrupt):
        # click turns Ctrl-C into Abort; the bundle writer has already removed its temporary directory.
        click.echo("interrupted: nothing was written (an existing bundle is untouched)", err=True)
        return 130
    except click.UsageError as exc:
        # One line, like every other user error, with where to read more.
        command = exc.ctx.command_path if exc.ctx is not None else "kvzap-export"
        click.echo(f"error: {exc.format_message()} (see `{command} --help`)", err=True)
        return 2
    except click.ClickException as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
