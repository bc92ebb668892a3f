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
@click.option("--data", "data", multiple=True, metavar="DIR_OR_FILE",
              help="Train on your own text instead of the built-in corpus (repeatable): .txt/.md/.rst files (one document "
                   "each), .jsonl files (one object with a \"text\" string per line), or folders holding them.")
@click.option("--prompts-per-domain", default=48, show_default=True,
              help="Prompts of 750-1250 tokens per training domain (or from --data); 1 in 8 is kept for in-domain evaluation.")
@click.option("--held-out-prompts", default=10, show_default=True, help="Evaluation prompts per held-out domain (legal, quotations).")
@click.option("--positions-per-prompt", default=0, show_default=True,
              help="Random token positions kept per training prompt; 0 keeps them all (the forward pass costs the same either "
                   "way; the fit reads the cache a span of layers at a time, and a run of which not even one layer's pairs "
                   "fit in memory is refused).")
@click.option("--hidden-dim", type=int, default=None, metavar="N",
              help="MLP hidden width. Default: the preset's surrogate.mlp_hidden_dim (hidden_size / 8 unless the preset says).")
@click.option("--epochs", default=15, show_default=True, help="MLP epochs.")
@click.option("--weight-decay", type=float, multiple=True, default=[0.1], show_default=True, metavar="WD",
              help="MLP AdamW weight decay (kvpress's script: 0.01). Repeat it to fit each layer once per value and keep the "
                   "one with the best R² on the validation prompts (1 in 8 training prompts, not trained on).")
@click.option("--seed", default=0, show_default=True)
@click.option("--cache-dir", type=click.Path(), default=None, help="Target cache (resumable). Default: DIR/targets-cache.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def train(model, variant, out, data, prompts_per_domain, held_out_prompts, positions_per_prompt, hidden_dim, epochs, weight_decay,
          seed, cache_dir, as_json) -> None:
    """Compute KVzip+ targets with the real model on varied offline text, fit the surrogate (ridge / MLP per
    layer) and report R² per layer and head for every domain: in-domain prompts never trained on, and held-out
    domains (legal and licence texts, quotations) whose kind of text was never trained on.

    \b
    Built-in corpus: narrative (KJV), expository (Jargon File), Q&A (Debian and Python FAQs), technical
    (Debian Reference, pydoc), code (CPython stdlib); install it with scripts/install_corpus.sh.
    Target collection is cached per prompt: an interrupted run resumes where it stopped.
    """
    from kvzap_export.cli.progress import progress_bars
    from kvzap_export.train.run import train_surrogate

    with progress_bars(enabled=not as_json) as progress:
        result = train_surrogate(model, variant, Path(out), prompts_per_domain, held_out_prompts, positions_per_prompt, epochs,
                                 list(weight_decay), seed, Path(cache_dir) if cache_dir else None, list(data) or None, progress,
                                 hidden_dim)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    for name, domains in result["variants"].items():
        click.echo(f"{name}: " + ", ".join(f"{d} R² {r2:.3f}" for d, r2 in domains.items()))
    click.echo(f"report: {Path(out) / 'report' / 'report.md'}")
