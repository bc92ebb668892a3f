import json

import pytest
import torch

from kvzap_export.errors import WeightsError
from kvzap_export.presets import load_preset
from kvzap_export.surrogate import load_surrogate, resolve_weights
from kvzap_export.surrogate.model import Surrogate, SurrogateConfig
from tests.helpers import synthetic_checkpoint


@pytest.fixture
def tiny_preset(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(
        "name: tiny\nhidden_size: 64\nnum_layers: 3\nnum_attention_heads: 4\nnum_kv_heads: 2\nhead_dim: 16\n"
        "surrogate:\n  hub_ids: {linear: nvidia/KVzap-linear-Tiny, mlp: nvidia/KVzap-mlp-Tiny}\n"
    )
    return load_preset(str(path))


@pytest.mark.parametrize("variant", ["linear", "mlp"])
def test_roundtrip_and_kvpress_compatibility(tiny_preset, tmp_path, variant):
    """Our checkpoint loads in kvpress's KVzapModel and gives the same scores, and vice versa."""
    from kvpress.presses.kvzap_press import KVzapModel

    directory = synthetic_checkpoint(tiny_preset, variant, tmp_path / "ckpt")
    ours = load_surrogate(directory, tiny_preset)
    theirs = KVzapModel.from_pretrained(str(directory)).eval()
    x = torch.randn(5, 64)
    for layer in range(3):
        torch.testing.assert_close(ours.score(layer, x), theirs.layers[layer](x), rtol=0, atol=0)
    # kvpress's own save_pretrained output loads in ours.
    theirs.save_pretrained(str(tmp_path / "theirs"))
    again = load_surrogate(tmp_path / "theirs", tiny_preset)
    torch.testing.assert_close(again.score(1, x), theirs.layers[1](x), rtol=0, atol=0)


def test_missing_weights_names_repo_and_command(tiny_preset, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(WeightsError) as info:
        resolve_weights(tiny_preset, "mlp")
    message = str(info.value)
    assert "nvidia/KVzap-mlp-Tiny" in message and "--weights" in message and "hf download" in message


def test_weights_dir_must_exist(tiny_preset, tmp_path):
    with pytest.raises(WeightsError, match="not a directory"):
        resolve_weights(tiny_preset, "mlp", tmp_path / "nope")


@pytest.mark.parametrize(
    "dims, expected",
    [((64, 2, 4), "n_modules=4"), ((32, 2, 3), "input_dim=32"), ((64, 3, 3), "output_dim=3")],
)
def test_checkpoint_shape_mismatch(tiny_preset, tmp_path, dims, expected):
    input_dim, output_dim, layers = dims
    Surrogate(SurrogateConfig(input_dim, output_dim, layers, 8)).save(tmp_path / "c")
    with pytest.raises(WeightsError, match=expected):
        load_surrogate(tmp_path / "c", tiny_preset)


def test_truncated_safetensors(tiny_preset, tmp_path):
    directory = synthetic_checkpoint(tiny_preset, "mlp", tmp_path / "c")
    data = (directory / "model.safetensors").read_bytes()
    (directory / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match="corrupt or truncated"):
        load_surrogate(directory, tiny_preset)


def test_safetensors_header_lies(tiny_preset, tmp_path):
    directory = synthetic_checkpoint(tiny_preset, "linear", tmp_path / "c")
    path = directory / "model.safetensors"
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    first = next(k for k in header if k != "__metadata__")
    start, end = header[first]["data_offsets"]
    header[first]["data_offsets"] = [start, end + 10_000_000]
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + raw[8 + n :])
    with pytest.raises(WeightsError, match="corrupt or truncated"):
        load_surrogate(directory, tiny_preset)


def test_non_finite_weights_are_refused(tiny_preset, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = synthetic_checkpoint(tiny_preset, "mlp", tmp_path / "c")
    state = load_file(str(directory / "model.safetensors"))
    state["layers.1.2.bias"][0] = float("nan")
    save_file(state, str(directory / "model.safetensors"))
    with pytest.raises(WeightsError, match="NaN or inf"):
        load_surrogate(directory, tiny_preset)


def test_integer_weights_are_refused(tiny_preset, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = synthetic_checkpoint(tiny_preset, "linear", tmp_path / "c")
    state = load_file(str(directory / "model.safetensors"))
    state["layers.0.weight"] = state["layers.0.weight"].to(torch.int32)
    save_file(state, str(directory / "model.safetensors"))
    with pytest.raises(WeightsError, match="floating point"):
        load_surrogate(directory, tiny_preset)


def test_pickle_checkpoint_is_refused(tiny_preset, tmp_path):
    directory = synthetic_checkpoint(tiny_preset, "linear", tmp_path / "c")
    (directory / "model.safetensors").unlink()
    torch.save({}, directory / "pytorch_model.bin")
    with pytest.raises(WeightsError, match="pickle checkpoints are refused"):
        load_surrogate(directory, tiny_preset)


def test_missing_config_keys(tiny_preset, tmp_path):
    directory = synthetic_checkpoint(tiny_preset, "linear", tmp_path / "c")
    cfg = json.loads((directory / "config.json").read_text())
    del cfg["n_modules"]
    (directory / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match="n_modules"):
        load_surrogate(directory, tiny_preset)


def test_bf16_checkpoint_is_accepted(tiny_preset, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = synthetic_checkpoint(tiny_preset, "mlp", tmp_path / "c")
    state = {k: v.to(torch.bfloat16) for k, v in load_file(str(directory / "model.safetensors")).items()}
    save_file(state, str(directory / "model.safetensors"))
    model = load_surrogate(directory, tiny_preset)
    assert model.layers[0][0].weight.dtype == torch.float32


def test_hub_id_resolves_from_the_local_cache_offline(tiny_preset, monkeypatch, tmp_path):
    """A checkpoint already in the Hugging Face cache is used without any network access."""
    cache = tmp_path / "hub"
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = cache / "models--nvidia--KVzap-linear-Tiny" / "snapshots" / revision
    synthetic_checkpoint(tiny_preset, "linear", snapshot)
    (cache / "models--nvidia--KVzap-linear-Tiny" / "refs").mkdir()
    (cache / "models--nvidia--KVzap-linear-Tiny" / "refs" / "main").write_text(revision)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    path = resolve_weights(tiny_preset, "linear")
    assert path.resolve() == snapshot.resolve()
    assert load_surrogate(path, tiny_preset).config.variant == "linear"
