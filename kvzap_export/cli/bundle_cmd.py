"""``kvzap-export inspect`` and ``kvzap-export verify``."""

from __future__ import annotations

import json

import click

from kvzap_export.errors import BundleError


@click.command()
@click.argument("bundle", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the problems as JSON.")
def verify(bundle: str, as_json: bool) -> None:
    """Check a bundle: schema, every sha256, every ONNX graph and its I/O, the surrogate's dimensions.

    TensorRT engines must match this machine's TensorRT version and GPU where TensorRT is importable; otherwise
    a note says they were not checked. Exits 0 when the bundle is intact, 2 listing every problem otherwise.
    """
    from kvzap_export.bundle.manifest import read_manifest
    from kvzap_export.bundle.verify import verify_bundle
    from kvzap_export.trt.compatibility import engine_compatibility

    problems = verify_bundle(bundle)
    engine_problems, notes = engine_compatibility(read_manifest(bundle))
    problems += engine_problems
    if as_json:
        click.echo(json.dumps({"bundle": bundle, "ok": not problems, "problems": problems, "notes": notes}, indent=2))
    else:
        for note in notes:
            click.echo(f"– {note}")
        if not problems:
            click.echo(f"✓ {bundle}: intact")
    if problems:
        if not as_json:
            for problem in problems:
                click.echo(f"✗ {problem}", err=True)
        raise BundleError(f"{bundle}: {len(problems)} problem(s) found; re-export the bundle")


@click.command()
@click.argument("bundle", type=click.Path())
def inspect(bundle: str) -> None:
    """Summarize a bundle: model, surrogate, pruning, artifacts, tools and parity results."""
    from rich.console import Console
    from rich.table import Table

    from kvzap_export.bundle.manifest import read_manifest
    from kvzap_export.cli.tables import print_whole

    m = read_manifest(bundle)
    model, sur, pruning = m["model"], m["surrogate"], m["pruning"]
    head = Table(title=f"kvzap-export bundle {bundle}", show_header=False)
    head.add_column("what", no_wrap=True)
    head.add_column("value", overflow="fold")  # long values wrap, and a long word (a path) folds: nothing is cut
    head.add_row("model", f"{model['preset']} ({model.get('hf_id') or '-'}): {model['num_layers']} layers, hidden "
                          f"{model['hidden_size']}, {model['num_attention_heads']} heads / {model['num_kv_heads']} KV heads × {model['head_dim']}")
    head.add_row("surrogate", f"{sur['variant']} (hidden {sur.get('hidden_dim') or '-'}) from {sur['source']}")
    head.add_row("pruning", f"τ = {pruning['threshold']:g}, window {pruning['window']}, sink {pruning['sink']}")
    head.add_row("graphs", f"{m['dtype']}, opset {m['opset']}, written by kvzap-export {m['kvzap_export_version']}")
    tools = ", ".join(f"{k} {v}" for k, v in m.get("tools", {}).items() if v)
    head.add_row("tools", tools + ("" if m.get("tools", {}).get("tensorrt") else "; TensorRT: none"))
    if m.get("parity"):
        head.add_row("verdict", m["parity"].get("summary") or m["parity"].get("verdict", "-"))
    Console().print(head)
    kinds: dict[str, int] = {}
    for artifact in m["artifacts"]:
        kinds[artifact["kind"]] = kinds.get(artifact["kind"], 0) + 1
    arts = Table(title="artifacts")
    arts.add_column("kind")
    arts.add_column("count")
    for kind, count in kinds.items():
        arts.add_row(kind, str(count))
    print_whole(arts)
    if m.get("parity"):
        from kvzap_export.pipeline import summary

        checks = Table(title=f"parity at export ({m['parity'].get('report', 'report/parity.md')})")
        checks.add_column("check")
        checks.add_column("status")
        for name, status in summary(m)["parity"].items():
            checks.add_row(name, str(status))
        print_whole(checks)
