"""``kvzap-export export`` and the bare pipeline command."""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvzap_export.cli.options import pipeline_options

_MARK = {"passed": "✓", "failed": "✗"}


def summary_lines(manifest: dict, out: Path) -> list[str]:
    """The summary as ``key  value`` lines; values are never cut (a long path just makes a long line)."""
    from kvzap_export.pipeline import summary

    model = manifest["model"]
    pruning = manifest["pruning"]
    parity = manifest.get("parity", {})
    rows = [("bundle", str(out)),
            ("verdict", parity.get("summary") or parity.get("verdict", "incomplete")),
            ("model", f"{model['preset']} ({model['num_layers']} layers, hidden {model['hidden_size']}, {model['num_kv_heads']} KV heads)"),
            ("surrogate", f"{manifest['surrogate']['variant']} from {manifest['surrogate']['source']}"),
            ("graphs", f"{len(manifest['artifacts'])} ONNX files, {manifest['dtype']}, opset {manifest['opset']}"),
            ("pruning", f"τ = {pruning['threshold']:g}, window {pruning['window']}, sink {pruning['sink']}")]
    layers = parity.get("surrogate_layers", {})
    for name, status in summary(manifest)["parity"].items():
        detail = f" (max abs err {layers['max_abs_error']:.2e})" if name == "operator:surrogate_layers" and layers.get("count") else ""
        rows.append((name, f"{_MARK.get(status, '–')} {status}{detail}"))
    for item in parity.get("not_run", []):
        rows.append(("did not run", f"{item['check']}: {item['reason']}"))
    rows.append(("TensorRT engines", manifest.get("engines", {}).get("status", "–")))
    if parity.get("report"):
        rows.append(("report", str(out / parity["report"])))
    width = max(len(key) for key, _ in rows)
    return [f"{key.ljust(width)}  {value}" for key, value in rows]


def verdict_line(manifest: dict, out: Path) -> str | None:
    """One line for a bundle written without a full pass (None when it passed)."""
    parity = manifest.get("parity", {})
    if parity.get("verdict") == "passed":
        return None
    missing = ", ".join(n["check"] for n in parity.get("not_run", [])) or "some checks"
    return f"bundle written to {out}, validation incomplete: {missing} did not run (see {out}/report/parity.md)" \
        if parity.get("report") else f"bundle written to {out}, not validated (--no-validate): run `kvzap-export validate {out}`"


def run_pipeline_from_cli(*, model, out, variant, weights, dtype, opset, threshold, window, sink, max_tokens,
                          force, quiet, as_json, no_validate=False, validate_model=None, require_trt=False, require=None) -> None:
    from kvzap_export.cli.progress import progress_bars
    from kvzap_export.errors import ValidationIncompleteError
    from kvzap_export.pipeline import ExportOptions, run_pipeline, summary
    from kvzap_export.validate.checks import parse_levels

    if model is None or out is None:
        raise click.UsageError("--model and --out are required")
    options = ExportOptions(model=model, out=Path(out), variant=variant, weights=weights, dtype=dtype, opset=opset,
                            threshold=threshold, window=window, sink=sink, max_tokens=max_tokens, force=force,
                            check=not no_validate, validate_model=validate_model, require_trt=require_trt,
                            require=parse_levels(require))
    with progress_bars(enabled=not (quiet or as_json)) as progress:
        manifest = run_pipeline(options, progress=progress)
    result = summary(manifest)
    result["out"] = str(Path(out).absolute())
    if as_json:
        click.echo(json.dumps(result, indent=2))
    elif not quiet:
        click.echo("\n".join(summary_lines(manifest, Path(out))), err=True)
    line = verdict_line(manifest, Path(out))
    if line and not no_validate:
        raise ValidationIncompleteError(line)  # the bundle is written; exit 3 says not everything was checked
    if line and not quiet and not as_json:
        click.echo(line, err=True)


@click.command()
@pipeline_options
def export(**options) -> None:
    """Export the surrogate (and compaction op) of a model to an ONNX bundle.

    \b
    Example:
      kvzap-export export --model llama-3.1-8b --weights ./KVzap-mlp-Llama-3.1-8B-Instruct --out engine/
    """
    run_pipeline_from_cli(**options)
