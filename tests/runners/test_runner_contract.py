"""Every runner passes the same contract: context manager, metadata, checked inputs, numpy outputs."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from kvzap_export.errors import InputError
from kvzap_export.runners.onnxrt_runner import OnnxrtRunner
from kvzap_export.runners.torch_ref import TorchRunner


@pytest.fixture
def double_graph(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "double", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    path = tmp_path / "double.onnx"
    onnx.save(model, str(path))
    return path


def _runners(path):
    return [
        TorchRunner(lambda x: x + x, {"x": ("float32", ["n", 4])}, ["y"]),
        OnnxrtRunner(path),
    ]


def test_contract(double_graph):
    feed = {"x": np.arange(12, dtype=np.float32).reshape(3, 4)}
    for runner in _runners(double_graph):
        with pytest.raises(RuntimeError, match="not active"):
            runner.infer(feed)
        with runner:
            meta = runner.get_input_metadata()
            assert list(meta) == ["x"] and meta["x"][0] == "float32" and meta["x"][1][1] == 4
            out = runner.infer(feed)
            assert list(out) == ["y"] and isinstance(out["y"], np.ndarray)
            np.testing.assert_array_equal(out["y"], feed["x"] * 2)
            assert runner.inference_time is not None and runner.inference_time >= 0
            with pytest.raises(InputError, match="dtype"):
                runner.infer({"x": feed["x"].astype(np.float64)})
            with pytest.raises(InputError, match="shape"):
                runner.infer({"x": np.zeros((3, 5), np.float32)})
            with pytest.raises(InputError, match="do not match"):
                runner.infer({"z": feed["x"]})
        assert not runner.is_active


def test_trt_runner_without_tensorrt_is_one_clear_error():
    import importlib.util

    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("TensorRT is installed here; this checks the message when it is absent")
    from kvzap_export.errors import MissingDependencyError
    from kvzap_export.runners.trt import TrtRunner

    with pytest.raises(MissingDependencyError, match="TensorRT is not installed"):
        TrtRunner("engine.plan")


@pytest.mark.trt
@pytest.mark.gpu
def test_trt_runner_contract(double_graph, tmp_path):
    """Builds a real engine from the tiny graph and runs the same contract (TensorRT + GPU machines only)."""
    import tensorrt as trt

    from kvzap_export.runners.trt import TrtRunner

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    assert parser.parse_from_file(str(double_graph))
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    profile.set_shape("x", (1, 4), (3, 4), (8, 4))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    (tmp_path / "double.plan").write_bytes(bytes(plan))
    with TrtRunner(tmp_path / "double.plan") as runner:
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        np.testing.assert_array_equal(runner.infer({"x": x})["y"], x * 2)
