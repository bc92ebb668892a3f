import json

import pytest

from kvzap_export.errors import ConfigError
from kvzap_export.presets import list_presets, load_preset

# Dimensions from each model's Hugging Face config.json.
EXPECTED = {
    "llama-3.1-8b": (4096, 32, 32, 8, 128, 512, "meta-llama/Llama-3.1-8B-Instruct"),
    "qwen3-8b": (4096, 36, 32, 8, 128, 512, "Qwen/Qwen3-8B"),
    "qwen3-32b": (5120, 64, 64, 8, 128, 640, "Qwen/Qwen3-32B"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_dimensions_and_hub_ids(name):
    p = load_preset(name)
    hidden, layers, heads, kv, head_dim, mlp, hf_id = EXPECTED[name]
    assert (p.hidden_size, p.num_layers, p.num_attention_heads, p.num_kv_heads, p.head_dim) == (hidden, layers, heads, kv, head_dim)
    assert p.mlp_hidden_dim == mlp == hidden // 8
    assert p.hf_id == hf_id
    basename = hf_id.split("/")[-1]
    assert p.hub_id("linear") == f"nvidia/KVzap-linear-{basename}"
    assert p.hub_id("mlp") == f"nvidia/KVzap-mlp-{basename}"
    assert p.pruning.threshold in p.pruning.thresholds_reported
    assert p.pruning.window == 128 and p.pruning.sink == 0


def test_every_shipped_preset_loads():
    assert set(EXPECTED) <= set(list_presets())
    for name in list_presets():
        assert load_preset(name).name == name


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ConfigError) as info:
        load_preset("llama-9000")
    for name in EXPECTED:
        assert name in str(info.value)


def _hf_config(tmp_path, **overrides):
    cfg = {"architectures": ["MistralForCausalLM"], "hidden_size": 1024, "num_hidden_layers": 4,
           "num_attention_heads": 16, "num_key_value_heads": 4, "_name_or_path": "acme/Tiny-Mistral", "torch_dtype": "bfloat16"}
    cfg.update(overrides)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_local_hf_directory_and_config_json(tmp_path):
    directory = _hf_config(tmp_path)
    for arg in (directory, directory / "config.json"):
        p = load_preset(str(arg))
        assert (p.hidden_size, p.num_layers, p.num_attention_heads, p.num_kv_heads, p.head_dim) == (1024, 4, 16, 4, 64)
        assert p.hub_id("mlp") == "nvidia/KVzap-mlp-Tiny-Mistral"
        assert p.mlp_hidden_dim == 128


def test_explicit_head_dim_is_respected(tmp_path):
    p = load_preset(str(_hf_config(tmp_path, head_dim=256)))
    assert p.head_dim == 256


def test_config_json_missing_keys(tmp_path):
    directory = _hf_config(tmp_path)
    cfg = json.loads((directory / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (directory / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        load_preset(str(directory))


def test_malformed_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nhidden_size: [1, 2\n")
    with pytest.raises(ConfigError, match="malformed YAML"):
        load_preset(str(bad))


def test_inconsistent_heads(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nhidden_size: 64\nnum_layers: 2\nnum_attention_heads: 6\nnum_kv_heads: 4\nhead_dim: 16\n")
    with pytest.raises(ConfigError, match="not a multiple"):
        load_preset(str(bad))


def test_non_positive_dimension(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nhidden_size: 0\nnum_layers: 2\nnum_attention_heads: 4\nnum_kv_heads: 4\nhead_dim: 16\n")
    with pytest.raises(ConfigError, match="hidden_size"):
        load_preset(str(bad))
