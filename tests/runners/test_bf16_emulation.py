"""bfloat16 graphs on ONNX Runtime CPU through the emulation rewrite: faithful to bfloat16 arithmetic."""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from kvzap_export.cli.main import main
from kvzap_export.export.compaction_onnx import kv_compaction_graph, threshold_compaction_graph
from kvzap_export.ops import kv_compaction, threshold_compaction
from kvzap_export.presets import load_preset
from kvzap_export.runners.bf16_emulation import emulate_bf16
from kvzap_export.runners.onnxrt_runner import OnnxrtRunner
from kvzap_export.surrogate import load_surrogate
from tests.helpers import synthetic_checkpoint

SMALL = "name: small\nhidden_size: 64\nnum_layers: 2\nnum_attention_heads: 4\nnum_kv_heads: 2\nhead_dim: 16\n"


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(emulate_bf16(model).SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def bf16_bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    (root / "small.yaml").write_text(SMALL)
    weights = synthetic_checkpoint(load_preset(str(root / "small.yaml")), "mlp", root / "w", scale=3.0)
    out = root / "b"
    assert main(["--model", str(root / "small.yaml"), "--weights", str(weights), "--out", str(out),
                 "--dtype", "bf16", "--quiet"]) == 3  # written; incomplete: no model ships for this preset
    return out


def test_emulated_surrogate_matches_torch_bfloat16(bf16_bundle):
    surrogate = load_surrogate(bf16_bundle / "surrogate")
    gen = torch.Generator().manual_seed(0)
    equal = total = 0
    for layer in range(2):
        model = onnx.load(str(bf16_bundle / "onnx" / f"surrogate_layer_{layer:03d}.onnx"))
        assert any(i.data_type == onnx.TensorProto.BFLOAT16 for i in model.graph.initializer)
        session = _session(model)
        for tokens in (1, 9, 300):
            x = (torch.randn(tokens, 64, generator=gen) * 2).to(torch.bfloat16)
            ref = surrogate.score(layer, x).float()
            got = torch.from_numpy(session.run(None, {"hidden_states": x.float().numpy()})[0])
            assert torch.equal(got, got.to(torch.bfloat16).float())  # outputs are bfloat16 values
            err = (ref - got).abs()
            assert float(err.max()) <= 8 * torch.finfo(torch.bfloat16).eps * max(1.0, float(ref.abs().max()))
            equal += int((err == 0).sum())
            total += err.numel()
    assert equal / total >= 0.99, f"only {equal}/{total} elements bit-exact"


def test_float32_feeds_are_rounded_to_bfloat16_on_entry(bf16_bundle):
    runner = OnnxrtRunner(bf16_bundle / "onnx" / "surrogate_layer_000.onnx", bf16_emulation=True)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    with runner:
        assert runner.backend == "onnxrt-bf16emu"
        raw = runner.infer({"hidden_states": x.numpy()})["scores"]
        rounded = runner.infer({"hidden_states": x.to(torch.bfloat16).float().numpy()})["scores"]
    np.testing.assert_array_equal(raw, rounded)


@pytest.mark.parametrize("tau", [-4.0, -4.3, 0.1])
def test_compaction_graph_compares_in_bfloat16_like_the_reference(tau):
    gen = torch.Generator().manual_seed(2)
    scores = (torch.randn(2, 3, 257, generator=gen) + tau).to(torch.bfloat16)
    scores[..., ::11] = torch.tensor(tau).to(torch.bfloat16)  # ties with τ rounded to bfloat16
    scores[..., 3::29] = float("nan")
    lengths = torch.tensor([257, 100], dtype=torch.int32)
    ref = threshold_compaction(scores, lengths, tau, 16)
    session = _session(threshold_compaction_graph(3, "bfloat16"))
    feed = {"scores": scores.float().numpy(), "lengths": lengths.numpy(), "threshold": np.array(tau, np.float32),
            "window": np.array(16, np.int32)}
    keep, counts, indices = session.run(["keep", "counts", "indices"], feed)
    np.testing.assert_array_equal(keep, ref.keep.numpy())
    np.testing.assert_array_equal(counts, ref.counts.numpy())
    np.testing.assert_array_equal(indices, ref.indices.numpy())
    # τ = -4.3 is not a bfloat16 value: a float32 comparison would decide some ties differently.
    if tau == -4.3:
        assert not torch.equal(ref.keep, threshold_compaction(scores.float(), lengths, tau, 16).keep)


def test_kv_compaction_graph_moves_bfloat16_values_exactly():
    gen = torch.Generator().manual_seed(3)
    keys, values = (torch.randn(1, 2, 50, 8, generator=gen).to(torch.bfloat16) for _ in range(2))
    indices = threshold_compaction(torch.randn(1, 2, 50, generator=gen), torch.tensor([50]), 0.0, 4).indices
    ref_k, ref_v = kv_compaction(keys, values, indices)
    session = _session(kv_compaction_graph(2, 8, "bfloat16"))
    got_k, got_v = session.run(["keys_out", "values_out"], {"keys": keys.float().numpy(), "values": values.float().numpy(),
                                                            "indices": indices.numpy()})
    np.testing.assert_array_equal(got_k, ref_k.float().numpy())
    np.testing.assert_array_equal(got_v, ref_v.float().numpy())


def test_bf16_bundle_validates_with_emulated_backend(bf16_bundle):
    report = json.loads((bf16_bundle / "report" / "parity.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert report["failed"] == [] and report["verdict"] == "incomplete"
    # what did not run: the model level (no model), and the plugin node in ORT (its ORT kernel takes float32 only)
    assert {n["check"] for n in report["not_run"]} == {"model:compacted_vs_kvpress", "operator:threshold_compaction_plugin"}
    assert checks["decision:keep_masks"]["status"] == "passed" and checks["decision:keep_masks"]["detail"]["hidden_states"] == "synthetic"
    assert checks["operator:threshold_compaction"]["detail"]["backend"] == "onnxrt-bf16emu"
    assert checks["operator:kv_compaction"]["status"] == "passed"
    layer = checks["operator:surrogate_layer_000"]
    assert layer["status"] == "passed" and layer["detail"]["backends"] == ["onnxrt-bf16emu"]


@pytest.mark.slow
def test_bf16_decisions_on_smollm2_flip_only_within_tolerance(tmp_path):
    """The embedded model's real hidden states, bfloat16 bundle: flips counted, none outside the tolerance."""
    out = tmp_path / "b"
    assert main(["--model", "smollm2-135m", "--out", str(out), "--dtype", "bf16", "--no-validate", "--quiet"]) == 0
    assert main(["validate", str(out), "--no-model-level", "--quiet"]) == 3  # incomplete: the model level did not run
    report = json.loads((out / "report" / "parity.json").read_text())
    decision = next(c for c in report["checks"] if c["name"] == "decision:keep_masks")
    detail = decision["detail"]
    assert decision["status"] == "passed" and detail["dtype"] == "bfloat16" and detail["backend"] == "onnxrt-bf16emu"
    assert detail["hidden_states"] == "real" and detail["tokens"] >= 2000 and detail["sequences"] >= 2
    assert detail["decisions_outside_window"] > 10_000 and detail["unexplained_flips"] == 0
    assert detail["explained_flips"] <= detail["explained_flip_budget"] == int(0.01 * detail["decisions_outside_window"])
    assert detail["tolerance"] == pytest.approx(8 * 2**-7 * 4)
    assert f"{detail['flips']} flips of {detail['decisions_outside_window']} decisions that can flip" in (out / "report" / "parity.md").read_text()
