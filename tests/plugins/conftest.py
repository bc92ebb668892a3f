"""The CUDA kernel library built once by nvcc for the plugins/ tests (skips where nvcc is not on PATH)."""

import shutil
from pathlib import Path

import pytest

from kvzap_export.kernels.cuda_lib import build_kernel_library


@pytest.fixture(scope="session")
def nvcc_library(tmp_path_factory) -> Path:
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc (CUDA toolkit) is not on PATH")
    return build_kernel_library(tmp_path_factory.mktemp("nvcc") / "libkvzap_kernels.so")
