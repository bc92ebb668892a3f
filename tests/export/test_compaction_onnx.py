"""The compaction graphs in ONNX Runtime agree exactly with the reference (property tests)."""

import numpy as np
import onnx
import pytest
import torch
from hypothesis import given, settings

from kvzap_export.export.compaction_onnx import PATHS, PLUGIN_OP, export_compaction_artifacts
from kvzap_export.ops import kv_compaction, threshold_compaction
from kvzap_export.runners.onnxrt_runner import OnnxrtRunner
from tests.ops.test_compaction import cases

HEADS = 4


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    directory = tmp_path_factory.mktemp("compaction")
    built = {}
    for sink in (0, 1, 4):
        for dtype in ("float32", "float16"):
            for art in export_compaction_artifacts(directory / f"{dtype}-{sink}", HEADS, 8, dtype, 20, sink):
                if art["kind"] == "threshold_compaction_plugin" and dtype != "float32":
                    continue
                runner = OnnxrtRunner(directory / f"{dtype}-{sink}" / art["path"], custom_ops=art["kind"].endswith("plugin"))
                runner.activate()
                built[(art["kind"], dtype, sink)] = runner
    yield built
    for runner in built.values():
        runner.deactivate()


def _feed(scores, lengths, threshold, window):
    return {"scores": scores.numpy(), "lengths": lengths.numpy(), "threshold": np.array(threshold, np.float32),
            "window": np.array(window, np.int32)}


@settings(max_examples=80, deadline=None)
@given(cases(max_heads=HEADS))
def test_std_ops_and_plugin_node_match_reference_exactly(runners, case):
    scores, lengths, threshold, window, sink = case
    scores = torch.cat([scores, scores[:, :1].expand(-1, HEADS - scores.shape[1], -1)], dim=1) if scores.shape[1] < HEADS else scores
    dtype = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "float32"}[scores.dtype]
    if scores.dtype == torch.bfloat16:
        scores = scores.float()  # numpy has no bf16; bf16 graphs are for TensorRT
    ref = threshold_compaction(scores, lengths, threshold, window, sink)
    kinds = ["threshold_compaction"] + (["threshold_compaction_plugin"] if dtype == "float32" else [])
    for kind in kinds:
        out = runners[(kind, dtype, sink)].infer(_feed(scores, lengths, threshold, window))
        assert np.array_equal(out["keep"], ref.keep.numpy()), kind
        assert np.array_equal(out["counts"], ref.counts.numpy()), kind
        assert np.array_equal(out["indices"], ref.indices.numpy()), kind


@settings(max_examples=30, deadline=None)
@given(cases(max_heads=HEADS))
def test_kv_compaction_graph_matches_reference(runners, case):
    scores, lengths, threshold, window, sink = case
    scores = scores.float()
    if scores.shape[1] < HEADS:
        scores = torch.cat([scores, scores[:, :1].expand(-1, HEADS - scores.shape[1], -1)], dim=1)
    indices = threshold_compaction(scores, lengths, threshold, window, sink).indices
    gen = torch.Generator().manual_seed(int(lengths.sum()))
    keys = torch.randn(*scores.shape, 8, generator=gen)
    values = torch.randn(*scores.shape, 8, generator=gen)
    out = runners[("kv_compaction", "float32", 0)].infer({"keys": keys.numpy(), "values": values.numpy(), "indices": indices.numpy()})
    ref_k, ref_v = kv_compaction(keys, values, indices)
    assert np.array_equal(out["keys_out"], ref_k.numpy()) and np.array_equal(out["values_out"], ref_v.numpy())


def test_std_ops_graph_is_tensorrt_friendly(tmp_path):
    export_compaction_artifacts(tmp_path, 8, 128, "float32", 18)
    model = onnx.load(str(tmp_path / PATHS["threshold_compaction"]))
    ops = {node.op_type for node in model.graph.node}
    assert not ops & {"TopK", "NonZero", "Compress", "Unique", "Loop", "If"}
    assert {"CumSum", "ScatterElements"} <= ops
    names = {i.name for i in model.graph.input}
    assert {"threshold", "window"} <= names  # one engine serves every threshold
    onnx.checker.check_model(model, full_check=True)


def test_plugin_node_attributes(tmp_path):
    export_compaction_artifacts(tmp_path, 8, 128, "float16", 20, sink=2)
    model = onnx.load(str(tmp_path / PATHS["threshold_compaction_plugin"]))
    node, cast = model.graph.node  # the plugin node, then keep cast to bool (TensorRT plugins cannot output bool)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert node.op_type == PLUGIN_OP
    assert attrs == {"plugin_version": b"1", "plugin_namespace": b"kvzap", "sink": 2}
    assert cast.op_type == "Cast" and list(cast.input) == [node.output[0]] and list(cast.output) == ["keep"]
    assert onnx.helper.get_attribute_value(cast.attribute[0]) == onnx.TensorProto.BOOL


@pytest.mark.slow
def test_128k_tokens_through_std_ops_graph(runners):
    seq = 131072
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(1, HEADS, seq, generator=gen)
    lengths = torch.tensor([seq], dtype=torch.int32)
    out = runners[("threshold_compaction", "float32", 0)].infer(_feed(scores, lengths, 0.5, 128))
    ref = threshold_compaction(scores, lengths, 0.5, 128)
    assert np.array_equal(out["indices"], ref.indices.numpy()) and np.array_equal(out["counts"], ref.counts.numpy())


@pytest.mark.parametrize("opset", [18, 19, 20])
def test_every_supported_opset_runs_and_matches(tmp_path, opset):
    from kvzap_export.runners.onnxrt import ort_session

    artifacts = {a["kind"]: a for a in export_compaction_artifacts(tmp_path, 3, 16, "fp32", opset)}
    assert onnx.load(str(tmp_path / PATHS["threshold_compaction"])).opset_import[0].version == opset
    gen = torch.Generator().manual_seed(opset)
    scores = torch.randn(2, 3, 300, generator=gen)
    scores[0, 1, 5] = float("nan")
    lengths = torch.tensor([300, 150], dtype=torch.int32)
    ref = threshold_compaction(scores, lengths, 0.25, 64, 0)
    for kind in ("threshold_compaction", "threshold_compaction_plugin"):
        session = ort_session(tmp_path / artifacts[kind]["path"], custom_ops=kind.endswith("plugin"))
        keep, counts, indices = session.run(None, _feed(scores, lengths, 0.25, 64))
        assert np.array_equal(keep, ref.keep.numpy()) and np.array_equal(counts, ref.counts.numpy())
        assert np.array_equal(indices, ref.indices.numpy()), kind


def test_export_is_deterministic_and_declares_io(tmp_path):
    first = export_compaction_artifacts(tmp_path / "a", 8, 128, "bf16", 20)
    second = export_compaction_artifacts(tmp_path / "b", 8, 128, "bfloat16", 20)
    assert first == second
    for art in first:
        assert (tmp_path / "a" / art["path"]).read_bytes() == (tmp_path / "b" / art["path"]).read_bytes()
    by_kind = {a["kind"]: a for a in first}
    assert set(by_kind) == {"threshold_compaction", "threshold_compaction_plugin", "kv_compaction"}
    for kind in ("threshold_compaction", "threshold_compaction_plugin"):
        assert by_kind[kind]["inputs"] == {"scores": ["bfloat16", ["batch", 8, "seq"]], "lengths": ["int32", ["batch"]],
                                           "threshold": ["float32", []], "window": ["int32", []]}
        assert by_kind[kind]["outputs"] == {"keep": ["bool", ["batch", 8, "seq"]], "counts": ["int32", ["batch", 8]],
                                            "indices": ["int32", ["batch", 8, "seq"]]}
    assert by_kind["kv_compaction"]["inputs"]["keys"] == ["bfloat16", ["batch", 8, "seq", 128]]
    assert by_kind["kv_compaction"]["outputs"]["values_out"] == ["bfloat16", ["batch", 8, "seq", 128]]


@pytest.mark.parametrize("kwargs, message", [
    ({"dtype": "int8"}, "--dtype 'int8' is not supported"),
    ({"opset": 21}, "--opset 21 is not supported"),
    ({"num_kv_heads": 0}, "num_kv_heads must be an integer >= 1"),
    ({"sink": -1}, "sink must be an integer >= 0"),
])
def test_bad_export_arguments_are_clear_errors(tmp_path, kwargs, message):
    from kvzap_export.errors import ConfigError

    args = {"num_kv_heads": 8, "head_dim": 128, "dtype": "float32", "opset": 20, **kwargs}
    with pytest.raises(ConfigError, match=message):
        export_compaction_artifacts(tmp_path, **args)
    assert not any(tmp_path.iterdir())
