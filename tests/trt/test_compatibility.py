"""Whether a bundle's engines fit this machine: the decisions, with a stand-in TensorRT version and GPU name."""

from types import SimpleNamespace

import pytest

from kvzap_export.trt import compatibility

ENGINE = {"kind": "trt_engine", "path": "engines/a.plan", "source": "onnx/a.onnx"}


def _manifest(**engines):
    return {"artifacts": [{"kind": "surrogate_layer", "path": "onnx/a.onnx"}, ENGINE],
            "engines": {"tensorrt": "11.4.0.106", "gpu": "NVIDIA H100 80GB HBM3", **engines}}


@pytest.fixture
def machine(monkeypatch):
    """This machine as the check sees it: a TensorRT version (or none) and a GPU name (or none)."""
    def set_machine(version: str | None, gpu: str | None):
        found = (SimpleNamespace(__version__=version), None) if version else (None, "TensorRT is not installed (...)")
        monkeypatch.setattr(compatibility, "import_tensorrt", lambda: found)
        monkeypatch.setattr(compatibility, "gpu_name", lambda: gpu)
    return set_machine


def test_no_engines_nothing_to_say(machine):
    machine(None, None)
    assert compatibility.engine_compatibility({"artifacts": []}) == ([], [])


def test_without_tensorrt_one_note(machine):
    machine(None, None)
    problems, notes = compatibility.engine_compatibility(_manifest())
    assert problems == [] and notes == ["1 TensorRT engine(s) not checked against this machine: TensorRT is not installed (...)"]


def test_same_version_and_gpu_is_clean(machine):
    machine("11.4.0.106", "NVIDIA H100 80GB HBM3")
    assert compatibility.engine_compatibility(_manifest()) == ([], [])


def test_another_version_is_a_problem_unless_version_compatible(machine):
    machine("11.5.0.1", "NVIDIA H100 80GB HBM3")
    problems, notes = compatibility.engine_compatibility(_manifest())
    assert len(problems) == 1 and "TensorRT 11.4.0.106, this machine has 11.5.0.1" in problems[0] and notes == []
    problems, notes = compatibility.engine_compatibility(_manifest(version_compatible=True))
    assert problems == [] and "version-compatible" in notes[0]


def test_another_gpu_is_a_problem_unless_hardware_compatible(machine):
    machine("11.4.0.106", "NVIDIA A100-SXM4-80GB")
    problems, notes = compatibility.engine_compatibility(_manifest())
    assert len(problems) == 1 and "this machine has 'NVIDIA A100-SXM4-80GB'" in problems[0]
    problems, notes = compatibility.engine_compatibility(_manifest(hardware_compat="ampere+"))
    assert problems == [] and "hardware compatibility 'ampere+'" in notes[0]
    machine("11.4.0.106", None)
    problems, notes = compatibility.engine_compatibility(_manifest())
    assert problems == [] and "no CUDA GPU is visible here" in notes[0]
