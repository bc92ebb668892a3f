"""The CUDA kernel library compiles (sm_80, sm_90) and, on a GPU, equals the reference exactly."""

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kvzap_export.ops import kv_compaction, threshold_compaction

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) is not on PATH")


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc (CUDA toolkit) is not on PATH")
    out = tmp_path_factory.mktemp("cuda") / "libkvzap_kernels.so"
    done = subprocess.run([NVCC, "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-shared", f"-I{PLUGINS / 'include'}",
                           "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
                           str(PLUGINS / "src" / "compaction.cu"), "-o", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@needs_nvcc
def test_nvcc_builds_sm80_and_sm90_with_the_c_abi(library):
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True).stdout
    assert " T kvzap_threshold_compaction" in symbols and " T kvzap_kv_compaction" in symbols
    binary = library.read_bytes()  # the fatbin names each embedded cubin's architecture
    assert b"sm_80" in binary and b"sm_90" in binary


@needs_nvcc
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not on PATH")
def test_cmake_builds_the_kernel_library_and_says_why_no_plugin(tmp_path):
    configure = subprocess.run(["cmake", "-S", str(PLUGINS), "-B", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert configure.returncode == 0, configure.stdout[-2000:] + configure.stderr[-2000:]
    build = subprocess.run(["cmake", "--build", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    assert (tmp_path / "libkvzap_kernels.so").is_file()
    if "TensorRT headers/library not found" in configure.stdout:
        assert not (tmp_path / "libkvzap_trt_plugin.so").exists()
    else:
        assert (tmp_path / "libkvzap_trt_plugin.so").is_file()


def _call_compaction(lib, scores, lengths, tau, window, sink):
    dtype = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[scores.dtype]
    batch, heads, seq = scores.shape
    keep = torch.empty(batch, heads, seq, dtype=torch.uint8, device="cuda")
    counts = torch.empty(batch, heads, dtype=torch.int32, device="cuda")
    indices = torch.empty(batch, heads, seq, dtype=torch.int32, device="cuda")
    tau_t = torch.tensor([tau], dtype=torch.float32, device="cuda")
    win_t = torch.tensor([window], dtype=torch.int32, device="cuda")
    lengths = lengths.to("cuda", torch.int32)
    status = lib.kvzap_threshold_compaction(
        ctypes.c_void_p(scores.data_ptr()), dtype, ctypes.c_void_p(lengths.data_ptr()), ctypes.c_void_p(tau_t.data_ptr()),
        ctypes.c_void_p(win_t.data_ptr()), batch, heads, seq, sink, ctypes.c_void_p(keep.data_ptr()),
        ctypes.c_void_p(counts.data_ptr()), ctypes.c_void_p(indices.data_ptr()), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    torch.cuda.synchronize()
    assert status == 0
    return keep.bool().cpu(), counts.cpu(), indices.cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_kernels_equal_the_reference(library, dtype):
    lib = ctypes.CDLL(str(library))
    gen = torch.Generator().manual_seed(0)
    scores = (torch.randn(2, 8, 5000, generator=gen) - 0.3).to(dtype)
    scores[..., ::97] = float("nan")
    scores[..., 5::89] = torch.tensor(-0.3).to(dtype)
    lengths = torch.tensor([5000, 1234])
    ref = threshold_compaction(scores, lengths, -0.3, 128, 4)
    got = _call_compaction(lib, scores.cuda(), lengths, -0.3, 128, 4)
    assert all(torch.equal(g, r) for g, r in zip(got, ref))
    keys, values = (torch.randn(2, 8, 5000, 128, generator=gen).to(dtype) for _ in range(2))
    k_out, v_out = torch.empty_like(keys, device="cuda"), torch.empty_like(values, device="cuda")
    kc, vc, ic = keys.cuda(), values.cuda(), ref.indices.cuda()
    status = lib.kvzap_kv_compaction(ctypes.c_void_p(kc.data_ptr()), ctypes.c_void_p(vc.data_ptr()), ctypes.c_void_p(ic.data_ptr()),
                                     2, 8, 5000, 128, keys.element_size(), ctypes.c_void_p(k_out.data_ptr()),
                                     ctypes.c_void_p(v_out.data_ptr()), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    torch.cuda.synchronize()
    assert status == 0
    ref_k, ref_v = kv_compaction(keys, values, ref.indices)
    assert torch.equal(k_out.cpu(), ref_k) and torch.equal(v_out.cpu(), ref_v)
