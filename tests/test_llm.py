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
def test_gguf_file_is_parsed_once_per_load(monkeypatch):
    """transformers parses the GGUF file for config, tokenizer, tokenizer config and weights separately and builds
    gguf's tensor-name table once per module; we hand out one parse and one table."""
    import gguf
    from gguf import gguf_reader, tensor_mapping

    from kvzap_export import llm as llm_module

    parses, tables = [], []
    original, original_table = gguf_reader.GGUFReader.__init__, tensor_mapping.TensorNameMap.__init__

    def counting(self, *args, **kwargs):
        parses.append(args[0] if args else kwargs.get("path"))
        return original(self, *args, **kwargs)

    def counting_table(self, *args, **kwargs):
        tables.append(args)
        return original_table(self, *args, **kwargs)

    monkeypatch.setattr(gguf_reader.GGUFReader, "__init__", counting)
    monkeypatch.setattr(tensor_mapping.TensorNameMap, "__init__", counting_table)
    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    model, tokenizer = llm_module.load_llm.__wrapped__("smollm2-135m")  # bypass the per-process cache
    assert len(parses) == 1  # 4 without the shared reader and metadata
    assert len(tables) == 1  # one per module of the model (397) without the cache
    assert tokenizer("KV cache", return_tensors="pt").input_ids.shape[1] >= 2 and model.config.num_hidden_layers == 30
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    assert gguf_utils.load_gguf_checkpoint.__name__ == "load_gguf_checkpoint"  # restored after the load
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, names)


@pytest.mark.slow
def test_reader_over_a_plain_array_reads_what_gguf_reads():
    """Inside the load, gguf's reader slices a plain ndarray over the same mapping: every field part and tensor
    must be byte-for-byte what gguf's own (memmap) reader gives."""
    import gguf
    import numpy as np

    from kvzap_export import llm as llm_module

    path = smollm2_gguf()
    theirs = gguf.GGUFReader(path)
    with llm_module._gguf_parsed_once():
        ours = gguf.GGUFReader(path)
    assert isinstance(theirs.data, np.memmap)
    assert type(ours.data) is np.ndarray and isinstance(ours.data.base, np.memmap)  # a view of the mapping, no copy
    assert list(ours.fields) == list(theirs.fields) and len(ours.fields["tokenizer.ggml.tokens"].data) > 49_000
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), name
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(mine.parts, field.parts, strict=True)), name
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, tensor in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == tensor.tensor_type and np.array_equal(mine.data, tensor.data), tensor.name


def test_nested_parsed_once_blocks_read_through_the_outer_reader(tmp_path):
    """A load inside another (e.g. two threads loading at once) finds gguf.GGUFReader already replaced."""
    import gguf
    import numpy as np

    from kvzap_export.llm import _gguf_parsed_once

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    original = gguf.GGUFReader
    with _gguf_parsed_once():
        outer = gguf.GGUFReader
        with _gguf_parsed_once():
            reader = gguf.GGUFReader(str(path))
        assert gguf.GGUFReader is outer
    assert gguf.GGUFReader is original
    assert type(reader.data) is np.ndarray and reader.tensors[0].data.tolist() == np.arange(12).reshape(3, 4).tolist()


def test_equal_length_batches_groups_by_length_in_order():
    from kvzap_export.llm import equal_length_batches

    assert equal_length_batches([400, 400, 212, 400, 212, 7]) == [[0, 1, 3], [2, 4], [5]]
    assert equal_length_batches([]) == []
