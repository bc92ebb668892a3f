"""The embedded SmolLM2 model loads offline and exposes the attention inputs KVzap scores."""

import pytest
import torch

from kvzap_export.errors import ConfigError
from kvzap_export.llm import capture_hidden_states, load_llm, smollm2_gguf
from kvzap_export.presets import load_preset


def test_gguf_is_located_without_importing_the_package():
    path = smollm2_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000


def test_preset_without_shipped_model_is_refused():
    with pytest.raises(ConfigError, match="not shipped"):
        load_llm("llama-3.1-8b")


@pytest.mark.slow
def test_smollm2_loads_and_matches_its_preset():
    llm, tokenizer = load_llm("smollm2-135m")
    preset = load_preset("smollm2-135m")
    cfg = llm.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        preset.hidden_size, preset.num_layers, preset.num_attention_heads, preset.num_kv_heads)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with capture_hidden_states(llm) as captured, torch.no_grad():
        llm(input_ids=ids)
    assert sorted(captured) == list(range(preset.num_layers))
    assert captured[0].shape == (1, ids.shape[1], preset.hidden_size)
    # Post-RMSNorm: each token's RMS is set by the norm weight, not the residual stream's growth.
    layer0 = llm.model.layers[0]
    with torch.no_grad():
        expected = layer0.input_layernorm(llm.model.embed_tokens(ids))
    torch.testing.assert_close(captured[0], expected)


@pytest.mark.slow
def test_gguf_metadata_is_parsed_once_per_load(monkeypatch):
    """transformers parses the GGUF file for config, tokenizer and tokenizer config separately; we hand out one parse."""
    from gguf import gguf_reader

    from kvzap_export import llm as llm_module

    parses = []
    original = gguf_reader.GGUFReader.__init__

    def counting(self, *args, **kwargs):
        parses.append(args[0] if args else kwargs.get("path"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(gguf_reader.GGUFReader, "__init__", counting)
    model, tokenizer = llm_module.load_llm.__wrapped__("smollm2-135m")  # bypass the per-process cache
    assert len(parses) == 2  # metadata once, weights once (4 without the shared metadata parse)
    assert tokenizer("KV cache", return_tensors="pt").input_ids.shape[1] >= 2 and model.config.num_hidden_layers == 30
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    assert gguf_utils.load_gguf_checkpoint.__name__ == "load_gguf_checkpoint"  # restored after the load
