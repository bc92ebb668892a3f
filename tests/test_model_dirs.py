"""``kvzap-export export-model``: the HF directory engines load, written where asked."""

import pytest

from kvzap_export.cli.main import main

pytest.importorskip("transformers", reason="export-model needs transformers (the model extra)")


def test_export_model_creates_missing_parent_directories(tmp_path, capsys):
    out = tmp_path / "models" / "tiny"  # models/ does not exist yet, as on a fresh clone
    assert main(["export-model", "tiny-qwen3", "--out", str(out)]) == 0
    assert (out / "config.json").is_file() and not list(tmp_path.glob("models/.*tmp*"))


def test_export_model_under_a_file_is_one_line_error(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["export-model", "tiny-qwen3", "--out", str(tmp_path / "file" / "tiny")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "is not a directory" in err and not (tmp_path / "file" / "tiny").exists()


def test_byte_tokenizer_round_trips_utf8_and_has_259_tokens():
    from kvzap_export.model_dirs import BYTE_SPECIALS, byte_tokenizer

    tokenizer = byte_tokenizer()
    text = "Hello, wörld!\n  x"
    ids = tokenizer(text)["input_ids"]
    assert ids == list(text.encode())  # one id per UTF-8 byte, in byte order, nothing added
    assert tokenizer.decode(ids) == text and len(tokenizer) == 259
    assert [tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token] == list(BYTE_SPECIALS)
    assert [tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id] == [256, 257, 258]


def test_tiny_llama_with_the_byte_vocabulary_is_a_small_gqa_llama_with_a_linear_surrogate(tmp_path, capsys):
    """export-model tiny-llama --byte-vocab: a Llama directory (8 query, 4 KV heads of 32), a vocabulary of 259, a few MB,
    seeded (the same seed writes the same weights, another seed others) and a linear kvpress surrogate beside it."""
    import json

    from safetensors.torch import load_file

    out = tmp_path / "llama"
    assert main(["export-model", "tiny-llama", "--byte-vocab", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 259
    assert config.get("eos_token_id") is None  # a 259-token model would pick its eos now and then (_special_ids)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (8, 4, 32)
    assert sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) < 3e6
    surrogate = json.loads((out / "kvzap-surrogate" / "config.json").read_text())
    assert surrogate["hidden_dim"] is None and surrogate["n_modules"] == 2 and surrogate["output_dim"] == 4
    assert main(["export-model", "tiny-llama", "--byte-vocab", "--out", str(tmp_path / "again")]) == 0
    assert main(["export-model", "tiny-llama", "--byte-vocab", "--seed", "1", "--out", str(tmp_path / "other")]) == 0
    weights = [load_file(str(d / "model.safetensors")) for d in (out, tmp_path / "again", tmp_path / "other")]
    name = "model.layers.0.self_attn.k_proj.weight"
    assert weights[0][name].equal(weights[1][name]) and not weights[0][name].equal(weights[2][name])


def test_byte_vocab_is_for_the_tiny_models_only(tmp_path, capsys):
    assert main(["export-model", "smollm2-135m", "--byte-vocab", "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--byte-vocab" in err and not (tmp_path / "m").exists()
