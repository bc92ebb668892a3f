"""plugins/: the CUDA kernel library compiles for sm_80 and sm_90 with its C ABI exported; CMake builds it (and
the TensorRT plugin where TensorRT headers exist, which a C++ driver then loads as TensorRT would); on a GPU the
kernels equal the PyTorch reference exactly.

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

from kvzap_export.kernels.cuda_lib import ABI, PLUGINS, CudaKernels, build_kernel_library
from kvzap_export.ops import Compaction, kv_compaction, threshold_compaction

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
def nvcc_library(tmp_path_factory) -> Path:
    if NVCC is None:
        pytest.skip("nvcc (CUDA toolkit) is not on PATH")
    return build_kernel_library(tmp_path_factory.mktemp("nvcc") / "libkvzap_kernels.so")


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
    from kvzap_export.errors import ConfigError, InputError

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


def _compaction(kernels: CudaKernels, scores, lengths, tau, window, sink, keep_dtype=torch.bool):
    """The validated binding, writing into outputs pre-filled with values no kernel may leave behind."""
    batch, heads, seq = scores.shape
    out = Compaction(torch.full((batch, heads, seq), 7, dtype=torch.uint8, device="cuda"),
                     torch.full((batch, heads), -7, dtype=torch.int32, device="cuda"),
                     torch.full((batch, heads, seq), -7, dtype=torch.int32, device="cuda"))
    keep = out.keep.view(torch.bool) if keep_dtype == torch.bool else out.keep.new_full((batch, heads, seq), 7, dtype=torch.int32)
    tau_t = torch.tensor(tau, dtype=torch.float32, device="cuda")
    win_t = torch.tensor(window, dtype=torch.int32, device="cuda")
    got = kernels.launch_threshold_compaction(scores, lengths.to("cuda", torch.int32), tau_t, win_t, sink, keep_dtype,
                                              out=Compaction(keep, out.counts, out.indices))
    torch.cuda.synchronize()
    raw = got.keep.view(torch.uint8) if keep_dtype == torch.bool else got.keep
    assert set(raw.unique().tolist()) <= {0, 1}
    return got.keep.bool().cpu(), got.counts.cpu(), got.indices.cpu()


def _move(kernels: CudaKernels, keys, values, indices, offset=0):
    """K/V move; ``offset`` > 0 shifts every pointer by that many elements (unaligned: the scalar paths)."""
    batch, heads, seq, dim = keys.shape
    k, v = (torch.cat([t.new_zeros(offset), t.flatten()]).cuda()[offset:].view(keys.shape) for t in (keys, values))
    k_out, v_out = (torch.full((keys.numel() + offset,), 3, dtype=keys.dtype, device="cuda")[offset:].view(keys.shape)
                    for _ in range(2))
    kernels.launch_kv_compaction(k, v, indices.to("cuda", torch.int32).contiguous(), out=(k_out, v_out))
    torch.cuda.synchronize()
    return k_out.cpu(), v_out.cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_kernels_equal_the_reference(nvcc_library, dtype):
    lib = CudaKernels(nvcc_library)
    gen = torch.Generator().manual_seed(0)
    scores = (torch.randn(3, 8, 5000, generator=gen) - 0.3).to(dtype)
    scores[..., ::97] = float("nan")
    scores[..., 5::89] = torch.tensor(-0.3).to(dtype)  # exactly tau rounded to the dtype: kept (strict <)
    lengths = torch.tensor([5000, 1234, 0])
    ref = threshold_compaction(scores, lengths, -0.3, 128, 4)
    for keep_dtype in (torch.bool, torch.int32):
        got = _compaction(lib, scores.cuda(), lengths, -0.3, 128, 4, keep_dtype)
        assert all(torch.equal(g, r) for g, r in zip(got, ref))
    validated = lib.threshold_compaction(scores.cuda(), lengths.cuda(), -0.3, 128, 4)  # the public binding
    assert all(torch.equal(g.cpu(), r) for g, r in zip(validated, ref))
    keys, values = (torch.randn(3, 8, 5000, 128, generator=gen).to(dtype) for _ in range(2))
    ref_k, ref_v = kv_compaction(keys, values, ref.indices)
    for offset in (0, 1):  # 16-byte vectors, then the unaligned fallback
        k_out, v_out = _move(lib, keys, values, ref.indices, offset)
        assert torch.equal(k_out, ref_k) and torch.equal(v_out, ref_v)
    k_out, v_out = lib.kv_compaction(keys.cuda(), values.cuda(), ref.indices.cuda())  # the public binding
    assert torch.equal(k_out.cpu(), ref_k) and torch.equal(v_out.cpu(), ref_v)


def _zeroed_out_of_range(indices: torch.Tensor, seq: int) -> torch.Tensor:
    """The move's contract for any index: one outside [0, seq) is "none" (-1), a zero row, and reads nothing."""
    return torch.where((indices >= 0) & (indices < seq), indices, -1)


def test_the_out_of_range_contract_is_the_reference_on_in_range_indices():
    """The host-side statement of the bound the GPU test below holds the CUDA move to."""
    indices = torch.tensor([[[2, 7, -5, 3, 0]]])
    assert _zeroed_out_of_range(indices, 4).tolist() == [[[2, -1, -1, 3, 0]]]
    keys = torch.arange(40, dtype=torch.float32).reshape(1, 1, 5, 8)
    k, _ = kv_compaction(keys[:, :, :4], keys[:, :, :4], _zeroed_out_of_range(indices[..., :4], 4))
    assert torch.equal(k[0, 0, 0], keys[0, 0, 2]) and not k[0, 0, 1:3].any() and torch.equal(k[0, 0, 3], keys[0, 0, 3])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kv_move_reads_nothing_for_out_of_range_indices(nvcc_library, dtype):
    """Indices past a head's rows give zero rows: nothing is read.

    keys, values and a tail of non-zero sentinels share one buffer, so an index past a head's rows that were read
    would copy the next head's entries, the values or a sentinel instead of zeros (and 1 << 30 would fault)."""
    lib = CudaKernels(nvcc_library)
    batch, heads, seq, dim = 2, 3, 50, 64
    gen = torch.Generator().manual_seed(2)
    indices = torch.randint(-3, 2 * seq, (batch, heads, seq), generator=gen, dtype=torch.int32)
    indices[..., 0], indices[..., 1] = 1 << 30, seq  # far past the allocation; the first row past the head
    keys = torch.randn(batch, heads, seq, dim, generator=gen).to(dtype)
    values = -keys
    expected = kv_compaction(keys, values, _zeroed_out_of_range(indices, seq))
    n = keys.numel()
    shared = torch.cat([keys.flatten(), values.flatten(), torch.full((heads * seq * dim,), 7.0, dtype=dtype)]).cuda()
    got = lib.launch_kv_compaction(shared[:n].view(keys.shape), shared[n: 2 * n].view(keys.shape), indices.cuda())
    torch.cuda.synchronize()
    assert torch.equal(got[0].cpu(), expected[0]) and torch.equal(got[1].cpu(), expected[1])


@pytest.mark.gpu
def test_cuda_kernels_cover_long_sequences_and_odd_rows(nvcc_library):
    """Past 65535 * 8 rows the move kernel strides over the grid's y limit; head_dim 3 in fp16 moves bytes."""
    lib = CudaKernels(nvcc_library)
    gen = torch.Generator().manual_seed(1)
    seq = 600_000
    scores = torch.randn(1, 1, seq, generator=gen)
    ref = threshold_compaction(scores, torch.tensor([seq - 5]), 0.5, 128)
    got = _compaction(lib, scores.cuda(), torch.tensor([seq - 5]), 0.5, 128, 0)
    assert all(torch.equal(g, r) for g, r in zip(got, ref))
    keys, values = (torch.randn(1, 1, seq, 4, generator=gen) for _ in range(2))
    k_out, v_out = _move(lib, keys, values, ref.indices)
    assert torch.equal(k_out, kv_compaction(keys, values, ref.indices)[0])
    keys, values = (torch.randn(2, 2, 300, 3, generator=gen).half() for _ in range(2))
    indices = threshold_compaction(torch.randn(2, 2, 300, generator=gen), torch.tensor([300, 17]), 0.0, 8).indices
    k_out, v_out = _move(lib, keys, values, indices)
    ref_k, ref_v = kv_compaction(keys, values, indices)
    assert torch.equal(k_out, ref_k) and torch.equal(v_out, ref_v)
