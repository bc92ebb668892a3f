"""ONNX Runtime sessions report the providers that ran, and refuse ONNX Runtime's silent fallback to the CPU."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from kvzap_export.errors import MissingDependencyError
from kvzap_export.runners.onnxrt import ort_session
from kvzap_export.runners.onnxrt_runner import OnnxrtRunner


def relu_graph(path):
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return path


@pytest.mark.filterwarnings("ignore:Specified provider:UserWarning")  # ORT's own warning: the fallback it takes
def test_a_provider_that_did_not_start_is_an_error_not_a_cpu_run(tmp_path):
    """Asked for CUDA where this ONNX Runtime has none, ORT warns and runs on the CPU; we refuse in one line (it
    used to run, and be reported, under the providers asked for)."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider: no fallback to show")
    with pytest.raises(MissingDependencyError, match="fell back to CPUExecutionProvider: CUDAExecutionProvider"):
        ort_session(str(relu_graph(tmp_path / "g.onnx")), providers=("CUDAExecutionProvider", "CPUExecutionProvider"))


def test_the_runner_reports_the_providers_its_session_used(tmp_path):
    runner = OnnxrtRunner(relu_graph(tmp_path / "g.onnx"))
    with runner:
        assert runner.infer({"x": np.array([-1.0, 2.0], np.float32)})["y"].tolist() == [0.0, 2.0]
        assert runner.providers_used == ("CPUExecutionProvider",)
