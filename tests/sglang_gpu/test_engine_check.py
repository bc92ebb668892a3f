"""``scripts/sglang_gpu/prepare_engine_check.py`` (``.gpu/engine-check``: what gpu_check.sh's SGLang steps run on a GPU
machine without network): the Llama-3.1-8B-shaped config, the plugin's entry point for a checkout on PYTHONPATH, the
size limit, the dummy-weights bundle, a refused build that leaves nothing behind, and the folder as prepared here (skips
where there is none)."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.sglang_gpu.engine_check import layout

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "sglang_gpu" / "prepare_engine_check.py"
PREPARED = REPO / ".gpu" / "engine-check"


def test_the_8b_config_has_llama_3_1_8b_shapes_as_the_toolkit_and_transformers_read_it(tmp_path):
    from transformers import LlamaConfig

    from kvzap_export.presets import load_preset

    layout.write_config_dir(tmp_path / "cfg")
    preset = load_preset(str(tmp_path / "cfg"))
    assert (preset.hidden_size, preset.num_layers, preset.num_attention_heads, preset.num_kv_heads, preset.head_dim) == \
        (4096, 32, 32, 8, 128) == tuple(map(load_preset("llama-3.1-8b").__getattribute__,
                                            ("hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim")))
    config = LlamaConfig.from_pretrained(str(tmp_path / "cfg"))
    assert config.vocab_size == 128256 and config.intermediate_size == 14336
    assert sorted(p.name for p in (tmp_path / "cfg").iterdir()) == ["config.json", "generation_config.json"]


def test_the_plugin_dist_info_exposes_the_checkouts_entry_point_to_importlib_metadata(tmp_path):
    points = layout.plugin_entry_points(REPO / "pyproject.toml")
    assert points == {"kvzap": "kvzap_export.integrations.sglang.plugin:load_plugin"}
    layout.write_files(tmp_path, layout.plugin_dist_files("kvzap-export", "0.1.0", points))
    (dist,) = importlib.metadata.distributions(path=[str(tmp_path)])
    assert dist.metadata["Name"] == "kvzap-export"
    (entry,) = [e for e in dist.entry_points if e.group == layout.ENTRY_GROUP]
    assert (entry.name, entry.value) == ("kvzap", "kvzap_export.integrations.sglang.plugin:load_plugin")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    with pytest.raises(ValueError, match="sglang.srt.plugins"):
        layout.plugin_entry_points(tmp_path / "pyproject.toml")


def test_sizes_and_the_limit(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_bytes(b"x" * 300)
    (tmp_path / "b.json").write_bytes(b"y" * 20)
    assert layout.sizes(tmp_path) == {"a": 300, "b.json": 20}
    layout.check_limit(320, 320)
    with pytest.raises(ValueError, match="0.0 MB, over the 0.0 MB limit"):
        layout.check_limit(321, 320)


def test_the_dummy_bundle_is_a_seeded_linear_surrogate_for_the_config_not_validated(tmp_path):
    """--dummy-bundle on a small config: the bundle's model is the config's, its surrogate a Linear, not validated;
    the same seed gives the same weights, another seed others."""
    config = tmp_path / "cfg"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}))
    shas = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        done = subprocess.run([sys.executable, str(SCRIPT), "--dummy-bundle", str(tmp_path / name), "--config", str(config),
                               "--seed", str(seed)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        manifest = json.loads((tmp_path / name / "manifest.json").read_text())
        shas.append(manifest["surrogate"]["sha256"])
    assert manifest["surrogate"]["variant"] == "linear" and manifest["model"]["num_kv_heads"] == 2
    assert manifest["parity"].get("verdict") != "passed" and not (tmp_path / "a" / "report" / "reference.json").exists()
    assert shas[0] == shas[1] != shas[2]
    assert "2 layers, hidden 64, linear surrogate, bfloat16" in done.stdout


def test_a_build_over_the_limit_is_one_line_and_leaves_an_earlier_folder_as_it_was(tmp_path):
    pytest.importorskip("kvpress", reason="the reference tokens need kvpress (the main environment)")
    out = tmp_path / "check"
    out.mkdir()
    (out / "earlier").write_text("kept")
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--limit-mb", "0.5"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "over the 0.5 MB limit" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["check"] and (out / "earlier").read_text() == "kept"


@pytest.fixture(scope="module")
def prepared() -> dict:
    if not (PREPARED / "manifest.json").is_file():
        pytest.skip("no .gpu/engine-check here: python scripts/sglang_gpu/prepare_engine_check.py")
    return json.loads((PREPARED / "manifest.json").read_text())


def test_the_prepared_folder_is_small_and_carries_kvpress_references_for_both_models(prepared):
    on_disk = sum(p.stat().st_size for p in PREPARED.rglob("*") if p.is_file())
    manifest_bytes = (PREPARED / "manifest.json").stat().st_size
    assert on_disk - manifest_bytes == prepared["total_bytes"]  # every file but manifest.json itself
    assert on_disk <= prepared["limit_bytes"] <= 8_000_000
    for name in layout.TINY_MODELS:
        reference = json.loads((PREPARED / prepared["models"][name]["bundle"] / "report" / "reference.json").read_text())
        assert len(reference["prompts"]) == layout.PROMPTS
        for prompt in reference["prompts"]:
            assert sorted(r["decoding"] for r in prompt["runs"]) == [False, True]
            assert all(len(r["output_ids"]) == layout.NEW_TOKENS for r in prompt["runs"])
    assert (PREPARED / layout.LLAMA_8B / "config.json").is_file()
    assert {v["variant"] for v in prepared["models"].values()} == {"linear", "mlp"}
