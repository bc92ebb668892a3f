"""plugins/: the CUDA kernel library compiles for sm_80 and sm_90 with its C ABI exported; CMake builds it (and
the TensorRT plugin where TensorRT headers exist, which a C++ driver then loads as TensorRT would). The kernels'
exactness on a GPU: test_cuda_kernels.py.

Without TensorRT headers (this project's CI) the plugin source is not compiled at all: the test that would do it
skips and says so. Point ``TensorRT_ROOT`` at a directory holding ``include/NvInferRuntime.h`` to run it.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kvzap_export.errors import InputError
from kvzap_export.kernels.cuda_lib import ABI, PLUGINS, CudaKernels

HARNESS = Path(__file__).with_name("plugin_harness.cpp")
NVCC = shutil.which("nvcc")
CMAKE = shutil.which("cmake")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) is not on PATH")


def _tensorrt_include() -> Path | None:
    """A directory holding TensorRT's NvInferRuntime.h: $TensorRT_ROOT/include, else the usual install places."""
    roots = [os.environ.get("TensorRT_ROOT"), "/usr/local/tensorrt", "/opt/tensorrt", "/usr"]
    for root in filter(None, roots):
        for sub in ("include", "include/x86_64-linux-gnu", "include/aarch64-linux-gnu"):
            if (Path(root) / sub / "NvInferRuntime.h").is_file():
                return Path(root) / sub
    return None


TRT_INCLUDE = _tensorrt_include()


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, **kwargs)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _exported(library: Path) -> set[str]:
    lines = _run(["nm", "-D", "--defined-only", str(library)]).stdout.splitlines()
    return {line.split()[-1] for line in lines if " T " in line}


def _architectures(library: Path) -> set[str]:
    """sm_XX named anywhere in a library (each cubin's ELF, and each PTX's .target, names its architecture)."""
    binary = library.read_bytes()
    return {f"sm_{arch}" for arch in (52, 60, 70, 75, 80, 86, 89, 90, 100, 120) if f"sm_{arch}".encode() in binary}


def _cuobjdump() -> str | None:
    """cuobjdump from the CUDA toolkit, else the copy Triton ships (nvcc-only installs have none of their own)."""
    if shutil.which("cuobjdump"):
        return shutil.which("cuobjdump")
    try:
        from triton import knobs

        path = knobs.nvidia.cuobjdump.path
    except (ModuleNotFoundError, AttributeError):
        return None
    return path if path and Path(path).is_file() else None


CUOBJDUMP = _cuobjdump()


def _embedded(library: Path) -> tuple[set[str], set[str]]:
    """(architectures of the SASS cubins, architectures of the PTX) in a library's fat binary, by cuobjdump."""
    listed = {}
    for kind in ("elf", "ptx"):
        lines = _run([CUOBJDUMP, f"--list-{kind}", str(library)]).stdout.splitlines()
        listed[kind] = {match for line in lines for match in re.findall(r"\.(sm_\d+a?)\.(?:cubin|ptx)$", line.strip())}
    return listed["elf"], listed["ptx"]


def _check_fat_binary(library: Path) -> None:
    """SASS for sm_80 and sm_90, and the PTX of sm_90 that a newer GPU's driver compiles (else it cannot load)."""
    assert _architectures(library) == {"sm_80", "sm_90"}
    if CUOBJDUMP is None:
        pytest.skip("cuobjdump not found (neither the CUDA toolkit's nor Triton's): the embedded PTX was not listed")
    assert _embedded(library) == ({"sm_80", "sm_90"}, {"sm_90"})


@pytest.fixture(scope="module")
def cmake_build(tmp_path_factory) -> tuple[Path, str]:
    """plugins/ configured and built by CMake with its defaults (and TensorRT_ROOT when headers were found)."""
    if NVCC is None or CMAKE is None:
        pytest.skip("needs nvcc and cmake on PATH")
    build = tmp_path_factory.mktemp("cmake")
    configure = [CMAKE, "-S", str(PLUGINS), "-B", str(build), f"-DCMAKE_CUDA_COMPILER={NVCC}"]
    if TRT_INCLUDE is not None:
        configure.append(f"-DTensorRT_ROOT={TRT_INCLUDE.parent}")
    env = {k: v for k, v in os.environ.items() if k != "CUDAARCHS"}  # the test checks the defaults
    configured = _run(configure, env=env)
    _run([CMAKE, "--build", str(build), "-j", "2"])
    return build, configured.stdout


@needs_nvcc
def test_nvcc_builds_sm80_and_sm90_and_ptx_with_the_c_abi(nvcc_library):
    assert set(ABI) <= _exported(nvcc_library)
    _check_fat_binary(nvcc_library)


@needs_nvcc
def test_the_binding_loads_the_library_and_validates_like_the_reference(nvcc_library, tmp_path):
    """No GPU needed: the library loads (CUDA runtime linked statically) and bad inputs fail before any launch."""
    from kvzap_export.errors import ConfigError

    kernels = CudaKernels(nvcc_library)
    assert kernels.lib.kvzap_threshold_compaction.restype is not None
    scores, lengths = torch.zeros(1, 2, 8), torch.tensor([8])
    with pytest.raises(InputError, match="one CUDA device"):
        kernels.threshold_compaction(scores, lengths, -4.0, 2)
    with pytest.raises(InputError, match="lengths must lie in"):  # the reference's own checks come first
        kernels.threshold_compaction(scores, torch.tensor([9]), -4.0, 2)
    with pytest.raises(InputError, match="one CUDA device"):
        kernels.kv_compaction(torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, dtype=torch.int32))
    with pytest.raises(InputError, match="indices must be below seq=8"):  # checked before the device, like lengths
        kernels.kv_compaction(torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 4), torch.full((1, 2, 8), 8, dtype=torch.int32))
    with pytest.raises(ConfigError, match="no such kernel library"):
        CudaKernels(tmp_path / "missing.so")


@needs_nvcc
@pytest.mark.skipif(CMAKE is None, reason="cmake is not on PATH")
def test_cmake_builds_the_kernels_for_sm80_and_sm90_and_ptx_by_default(cmake_build):
    build, configured = cmake_build
    library = build / "libkvzap_kernels.so"
    assert set(ABI) <= _exported(library)
    if TRT_INCLUDE is None:
        assert "TensorRT headers not found" in configured and "no TensorRT plugin" in configured
        assert not list(build.glob("libkvzap_trt_plugin*.so"))
    else:
        assert (build / "libkvzap_trt_plugin.so").is_file()
    # project() alone would pick nvcc's default architecture; the CMakeLists sets 80-real;90 before it.
    _check_fat_binary(library)


@needs_nvcc
@pytest.mark.skipif(CMAKE is None, reason="cmake is not on PATH")
@pytest.mark.skipif(TRT_INCLUDE is None, reason="TensorRT headers (NvInferRuntime.h) not found: the IPluginV3 plugin "
                    "source was not compiled here; set TensorRT_ROOT to a TensorRT install to compile and load it")
def test_plugin_builds_exports_its_entry_points_and_behaves_as_tensorrt_expects(cmake_build, tmp_path):
    build, _ = cmake_build
    plugin = build / "libkvzap_trt_plugin.so"
    assert {"getCreators", "setLoggerFinder", *ABI} <= _exported(plugin)
    undefined = _run(["nm", "-D", "--undefined-only", str(plugin)]).stdout
    # No libnvinfer symbol: the library loads into any TensorRT 10/11 process (and the lean runtime).
    assert "getPluginRegistry" not in undefined and "nvinfer1" not in undefined
    driver = tmp_path / "plugin_harness"
    # nvcc compiles the .cpp with the host compiler and adds the CUDA include path the TensorRT headers need.
    _run([NVCC, "-std=c++17", "-Xcompiler", "-Wall,-Wextra", "-isystem", str(TRT_INCLUDE), str(HARNESS), "-o", str(driver), "-ldl"])
    assert _run([str(driver), str(plugin)]).stdout.strip() == "ok"
