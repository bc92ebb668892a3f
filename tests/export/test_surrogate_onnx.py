"""Per-layer surrogate ONNX files vs kvpress's own KVzapModel, at every preset's exact shapes."""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from kvzap_export.cli.main import main
from kvzap_export.presets import load_preset
from kvzap_export.surrogate.model import Surrogate, SurrogateConfig
from kvzap_export.export.surrogate_onnx import export_surrogate
from tests.helpers import synthetic_checkpoint

TOKEN_COUNTS = (1, 5, 77)  # the export sample has 3 tokens


def _session(path):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["linear", "mlp"])
@pytest.mark.parametrize("preset_name", ["llama-3.1-8b", "qwen3-8b", "qwen3-32b"])
def test_cli_bundle_matches_kvpress(preset_name, variant, tmp_path):
    from kvpress.presses.kvzap_press import KVzapModel

    preset = load_preset(preset_name)
    weights = synthetic_checkpoint(preset, variant, tmp_path / "weights", seed=1)
    out = tmp_path / "engine"
    # No local model for these presets: written with an incomplete validation (exit 3)
    assert main(["--model", preset_name, "--variant", variant, "--weights", str(weights), "--out", str(out), "--quiet"]) == 3

    manifest = json.loads((out / "manifest.json").read_text())
    layers = [a for a in manifest["artifacts"] if a["kind"] == "surrogate_layer"]
    assert [a["layer"] for a in layers] == list(range(preset.num_layers))
    assert manifest["model"]["num_kv_heads"] == preset.num_kv_heads
    assert manifest["parity"]["verdict"] == "incomplete" and manifest["parity"]["failed"] == []
    assert [n["check"] for n in manifest["parity"]["not_run"]] == ["model:compacted_vs_kvpress"]
    assert manifest["parity"]["surrogate_layers"]["status"] == "passed"

    reference = KVzapModel.from_pretrained(str(out / "surrogate")).eval()  # the bundle's copy loads in kvpress
    generator = torch.Generator().manual_seed(0)
    # Every layer is checked at one token count (rotating), the first and last at all three.
    for artifact in layers:
        layer = artifact["layer"]
        session = _session(out / artifact["path"])
        counts = TOKEN_COUNTS if layer in (0, preset.num_layers - 1) else (TOKEN_COUNTS[layer % 3],)
        for count in counts:
            x = torch.randn(count, preset.hidden_size, generator=generator) * 3
            with torch.no_grad():
                ref = reference.layers[layer](x).numpy()
            (got,) = session.run(None, {"hidden_states": x.numpy()})
            assert got.shape == (count, preset.num_kv_heads)
            assert (np.abs(got - ref) <= 1e-5 * np.maximum(1.0, np.abs(ref))).all(), (layer, count, np.abs(got - ref).max())


def _tiny(variant="mlp", layers=2):
    torch.manual_seed(0)
    return Surrogate(SurrogateConfig(96, 3, layers, 12 if variant == "mlp" else None)).eval()


@pytest.mark.parametrize("opset", [18, 19, 20])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_graph_contract_every_dtype_and_opset(tmp_path, dtype, opset):
    surrogate = _tiny()
    artifacts = export_surrogate(surrogate, tmp_path, dtype, opset)
    elem = {"float32": onnx.TensorProto.FLOAT, "float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}[dtype]
    for artifact in artifacts:
        model = onnx.load(str(tmp_path / artifact["path"]))
        onnx.checker.check_model(model, full_check=True)
        assert model.opset_import[0].version == opset
        (inp,), (out,) = model.graph.input, model.graph.output
        assert inp.name == "hidden_states" and out.name == "scores"
        assert inp.type.tensor_type.elem_type == elem and out.type.tensor_type.elem_type == elem
        assert [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim] == ["num_tokens", 96]
        assert [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim] == ["num_tokens", 3]
        weights = {i.name: i for i in model.graph.initializer}
        assert weights["0.weight"].data_type == elem  # weights cast to the activation dtype, as kvpress


@pytest.mark.parametrize("variant", ["linear", "mlp"])
def test_float16_numerics(tmp_path, variant):
    surrogate = _tiny(variant)
    artifacts = export_surrogate(surrogate, tmp_path, "float16", 20)
    x = torch.randn(9, 96).half()
    for artifact in artifacts:
        (got,) = _session(tmp_path / artifact["path"]).run(None, {"hidden_states": x.numpy()})
        ref = surrogate.score(artifact["layer"], x).float().numpy()
        assert got.dtype == np.float16
        assert np.abs(got.astype(np.float32) - ref).max() <= 4e-3 * max(1.0, np.abs(ref).max())


def test_bfloat16_weights_are_the_rounded_reference(tmp_path):
    """ORT CPU cannot run bf16 Gemm; the weights in the graph must be exactly kvpress's bf16 cast."""
    surrogate = _tiny()
    (artifact, _) = export_surrogate(surrogate, tmp_path, "bfloat16", 20)
    model = onnx.load(str(tmp_path / artifact["path"]))
    init = next(i for i in model.graph.initializer if i.name == "0.weight")
    stored = torch.frombuffer(bytearray(init.raw_data), dtype=torch.bfloat16).reshape(list(init.dims))
    assert torch.equal(stored, surrogate.layers[0][0].weight.detach().to(torch.bfloat16))


def test_layers_carry_their_own_weights(tmp_path):
    surrogate = _tiny(layers=3)
    artifacts = export_surrogate(surrogate, tmp_path, "float32", 20)
    x = torch.randn(4, 96)
    outputs = [_session(tmp_path / a["path"]).run(None, {"hidden_states": x.numpy()})[0] for a in artifacts]
    for layer, got in enumerate(outputs):
        np.testing.assert_allclose(got, surrogate.score(layer, x).detach().numpy(), rtol=1e-5, atol=1e-6)
    assert not np.allclose(outputs[0], outputs[1])


def test_same_inputs_give_byte_identical_bundles(tmp_path):
    small = tmp_path / "small.yaml"
    small.write_text(
        "name: small\nhidden_size: 256\nnum_layers: 4\nnum_attention_heads: 8\nnum_kv_heads: 2\nhead_dim: 32\n"
    )
    weights = synthetic_checkpoint(load_preset(str(small)), "mlp", tmp_path / "w")
    manifests = []
    for run in ("a", "b"):
        out = tmp_path / run
        assert main(["--model", str(small), "--weights", str(weights), "--out", str(out), "--quiet"]) == 3  # incomplete: no model
        manifests.append(json.loads((out / "manifest.json").read_text()))
    first, second = ({a["path"]: a["sha256"] for a in m["artifacts"]} for m in manifests)
    assert first == second and len(first) >= 4
    assert manifests[0]["files"]["surrogate/model.safetensors"] == manifests[1]["files"]["surrogate/model.safetensors"]
