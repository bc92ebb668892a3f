"""Shared test configuration: hardware markers skip with a reason when the hardware is absent."""

from __future__ import annotations

import importlib.util
import os

import pytest

# Without a GPU, Triton kernels run in Triton's CPU interpreter. It must be chosen before any kernel is
# defined (at import of kvzap_export.kernels.triton_compaction), hence here, before test collection.
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ModuleNotFoundError:
        pass


def _cuda_available() -> bool:
    try:
        import torch
    except ModuleNotFoundError:
        return False
    return torch.cuda.is_available()


def sglang_python() -> str | None:
    """The engine environment's Python for ``sglang``-marked tests: $KVZAP_SGLANG_PYTHON if it exists."""
    path = os.environ.get("KVZAP_SGLANG_PYTHON")
    return path if path and os.path.isfile(path) else None


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is visible to torch on this machine")
    no_trt = pytest.mark.skip(reason="needs TensorRT (`import tensorrt`); it is not installed on this machine")
    no_sglang = pytest.mark.skip(reason="needs the SGLang engine environment: set KVZAP_SGLANG_PYTHON to DIR/bin/python "
                                        "after `bash scripts/sglang_cpu_env.sh DIR` (.ci/run does both)")
    has_gpu = _cuda_available()
    has_trt = importlib.util.find_spec("tensorrt") is not None
    has_sglang = sglang_python() is not None
    for item in items:
        if item.get_closest_marker("sglang") and not has_sglang:
            item.add_marker(no_sglang)
        if item.get_closest_marker("gpu") and not has_gpu:
            item.add_marker(no_gpu)
        if item.get_closest_marker("trt") and not has_trt:
            item.add_marker(no_trt)
