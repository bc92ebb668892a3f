"""``kvzap-export presets``: list the shipped model presets."""

from __future__ import annotations

import json

import click


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the resolved presets as JSON.")
def presets(as_json: bool) -> None:
    """List the model presets shipped with the toolkit and their dimensions."""
    from kvzap_export.presets import list_presets, load_preset

    resolved = [load_preset(name) for name in list_presets()]
    if as_json:
        click.echo(json.dumps([p.to_dict() for p in resolved], indent=2))
        return
    from rich.table import Table

    from kvzap_export.cli.tables import print_whole

    table = Table(title="kvzap-export presets")
    for col in ("preset", "layers", "hidden", "heads", "KV heads", "head dim", "MLP hidden", "τ", "HF model"):
        table.add_column(col, no_wrap=True, justify="right" if col not in ("preset", "HF model") else "left")
    for p in resolved:
        table.add_row(p.name, str(p.num_layers), str(p.hidden_size), str(p.num_attention_heads), str(p.num_kv_heads),
                      str(p.head_dim), str(p.mlp_hidden_dim), f"{p.pruning.threshold:g}", p.hf_id or "-")
    print_whole(table)  # never cuts a name, however narrow the terminal
