"""Shared test configuration: hardware markers skip with a reason when the hardware is absent."""

from __future__ import annotations

import importlib.util
import os

import pytest

# Under pytest-xdist (CI: -n 2) each worker gets its share of the cores, for torch here and for the processes the tests
# start (SGLang engines, the CLI): torch's threads spin while they wait, and two workers of all cores each stall one
# another. Set before torch is imported; an OMP_NUM_THREADS already set is kept.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

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


def sglang_kernel_source() -> str | None:
    """A path (or "" for the installed package) holding SGLang's kernel files, or None: the installed sglang, else the
    site-packages of $KVZAP_SGLANG_PYTHON (the engine environment CI builds), else $KVZAP_SGLANG_KERNELS (the wheel, or
    a directory holding sglang/kernels/ops/attention/)."""
    import subprocess
    from pathlib import Path

    if importlib.util.find_spec("sglang") is not None:
        return ""
    python = sglang_python()
    if python:
        purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, timeout=60).stdout.strip()
        if purelib and (Path(purelib) / "sglang/kernels/ops/attention/decode_attention.py").is_file():
            return purelib
    wheel = os.environ.get("KVZAP_SGLANG_KERNELS")
    return wheel if wheel and os.path.exists(wheel) else None


@pytest.fixture(scope="session")
def sglang_kernel_path():
    """Where SGLang's kernel files are (None: the installed package); skips, saying so, where there are none."""
    found = sglang_kernel_source()
    if found is None:
        pytest.skip("needs SGLang's kernel file: sglang installed here, $KVZAP_SGLANG_PYTHON (the engine environment, "
                    "scripts/sglang_cpu_env.sh) or $KVZAP_SGLANG_KERNELS (the sglang 0.5.23 wheel)")
    return found or None


@pytest.fixture(scope="session")
def sglang_kernels(sglang_kernel_path):
    """SGLang's Triton attention kernels, loaded once (``kernels.sglang_kernels.load``)."""
    from kvzap_export.kernels import sglang_kernels as loader

    return loader.load(sglang_kernel_path)


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
