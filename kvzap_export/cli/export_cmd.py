"""``kvzap-export export`` and the bare pipeline command."""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvzap_export.cli.options import pipeline_options


def _print_summary(manifest: dict, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"bundle {out}", show_header=False)
    model = manifest["model"]
    table.add_row("model", f"{model['preset']} ({model['num_layers']} layers, hidden {model['hidden_size']}, {model['num_kv_heads']} KV heads)")
    table.add_row("surrogate", f"{manifest['surrogate']['variant']} from {manifest['surrogate']['source']}")
    table.add_row("graphs", f"{len(manifest['artifacts'])} ONNX files, {manifest['dtype']}, opset {manifest['opset']}")
    pruning = manifest["pruning"]
    table.add_row("pruning", f"τ = {pruning['threshold']:g}, window {pruning['window']}, sink {pruning['sink']}")
    from kvzap_export.pipeline import summary

    layers = manifest.get("parity", {}).get("surrogate_layers", {})
    for name, status in summary(manifest)["parity"].items():
        mark = {"passed": "✓", "failed": "✗"}.get(status, "–")
        detail = f" (max abs err {layers['max_abs_error']:.2e})" if name == "operator:surrogate_layers" and layers.get("count") else ""
        table.add_row(name, f"{mark} {status}{detail}")
    engines = manifest.get("engines", {})
    table.add_row("TensorRT engines", engines.get("status", "–"))
    if manifest.get("parity"):
        table.add_row("report", str(out / manifest["parity"]["report"]))
    Console(stderr=True).print(table)


def run_pipeline_from_cli(*, model, out, variant, weights, dtype, opset, threshold, window, sink, max_tokens,
                          force, quiet, as_json, no_validate=False, validate_model=None, require_trt=False) -> None:
    from kvzap_export.cli.progress import progress_bars
    from kvzap_export.pipeline import ExportOptions, run_pipeline, summary

    if model is None or out is None:
        raise click.UsageError("--model and --out are required")
    options = ExportOptions(model=model, out=Path(out), variant=variant, weights=weights, dtype=dtype, opset=opset,
                            threshold=threshold, window=window, sink=sink, max_tokens=max_tokens, force=force,
                            check=not no_validate, extra={"validate_model": validate_model, "require_trt": require_trt})
    with progress_bars(enabled=not (quiet or as_json)) as progress:
        manifest = run_pipeline(options, progress=progress)
    result = summary(manifest)
    result["out"] = str(Path(out).absolute())
    if as_json:
        click.echo(json.dumps(result, indent=2))
    elif not quiet:
        _print_summary(manifest, Path(out))


@click.command()
@pipeline_options
def export(**options) -> None:
    """Export the surrogate (and compaction op) of a model to an ONNX bundle.

    \b
    Example:
      kvzap-export export --model llama-3.1-8b --weights ./KVzap-mlp-Llama-3.1-8B-Instruct --out engine/
    """
    run_pipeline_from_cli(**options)
