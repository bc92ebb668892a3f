"""``kvzap-export train``: distil KVzip+ into a surrogate for any Llama/Qwen/Mistral-style model."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command()
@click.option("--model", "-m", required=True, metavar="PRESET|PATH", help="Preset with a shipped model (smollm2-135m) or a local HF model directory.")
@click.option("--variant", type=click.Choice(["linear", "mlp", "both"]), default="both", show_default=True,
              help="Which surrogate(s) to fit; 'both' writes DIR/linear and DIR/mlp.")
@click.option("--out", "-o", required=True, type=click.Path(), metavar="DIR", help="Where the kvpress-format checkpoint(s) and report/ go.")
@click.option("--num-prompts", default=48, show_default=True, help="Prompts of 750-1250 tokens from offline text (1 in 8 held out).")
@click.option("--positions-per-prompt", default=500, show_default=True, help="Random token positions kept per training prompt.")
@click.option("--epochs", default=15, show_default=True, help="MLP epochs.")
@click.option("--seed", default=0, show_default=True)
@click.option("--cache-dir", type=click.Path(), default=None, help="Target cache (resumable). Default: DIR/targets-cache.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def train(model, variant, out, num_prompts, positions_per_prompt, epochs, seed, cache_dir, as_json) -> None:
    """Compute KVzip+ targets on offline text (Python docs and stdlib sources) with the real model,
    fit the surrogate (ridge / MLP per layer) and report held-out R² per layer and head.
    Target collection is cached per prompt: an interrupted run resumes where it stopped.
    """
    from kvzap_export.cli.progress import progress_bars
    from kvzap_export.train.run import train_surrogate

    with progress_bars(enabled=not as_json) as progress:
        result = train_surrogate(model, variant, Path(out), num_prompts, positions_per_prompt, epochs, seed,
                                 Path(cache_dir) if cache_dir else None, progress)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        for name, r2 in result["variants"].items():
            click.echo(f"{name}: mean held-out R² {r2:.3f}")
        click.echo(f"report: {Path(out) / 'report' / 'report.md'}")
