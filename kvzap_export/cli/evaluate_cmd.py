"""``kvzap-export evaluate``: the "does pruning hurt?" picture."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command()
@click.option("--model", "-m", default="smollm2-135m", show_default=True, metavar="PRESET|PATH")
@click.option("--variant", type=click.Choice(["linear", "mlp"]), default="mlp", show_default=True)
@click.option("--weights", default=None, metavar="DIR", help="Surrogate checkpoint (default: the preset's shipped one).")
@click.option("--threshold", "thresholds", multiple=True, type=float, help="τ to evaluate (repeatable). Default: 5 quantiles of the scores.")
@click.option("--text", "text", type=click.Choice(["legal", "quotations", "python-docs"]), default="legal", show_default=True,
              help="Text the shipped surrogate never trained on: a held-out domain (legal and licence texts, quotations) "
                   "or the Python documentation reserved for validation.")
@click.option("--prompts", default=4, show_default=True, help="Prompts of that text.")
@click.option("--prompt-tokens", default=600, show_default=True)
@click.option("--new-tokens", default=64, show_default=True, help="Continuation tokens (teacher-forced).")
@click.option("--out", "-o", required=True, type=click.Path(), help="Directory for evaluate.{md,json} and the plot.")
@click.option("--json", "as_json", is_flag=True)
def evaluate(model, variant, weights, thresholds, text, prompts, prompt_tokens, new_tokens, out, as_json) -> None:
    """Sweep thresholds on held-out text; compare KVzap with random eviction and keep-most-recent at equal
    compression: next-token agreement with the full cache and continuation perplexity, with a plot."""
    from kvzap_export.cli.progress import progress_bars
    from kvzap_export.evaluate.run import evaluate_quality, write_evaluation

    with progress_bars(enabled=not as_json) as progress:
        report = evaluate_quality(model, variant, weights, thresholds or None, prompts, prompt_tokens, new_tokens,
                                   progress=progress, text=text)
    write_evaluation(Path(out), report)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo((Path(out) / "evaluate.md").read_text())
