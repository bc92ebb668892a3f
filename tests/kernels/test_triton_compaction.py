"""The Triton kernels equal the reference exactly (CPU: Triton's interpreter; GPU: the real kernels).

Without a GPU the kernels must be defined under ``TRITON_INTERPRET=1`` (triton.jit reads it when a kernel
is decorated, i.e. when ``kvzap_export.kernels.triton_compaction`` is imported). tests/conftest.py sets it;
this module sets it too before its import, so the file also runs alone. Whether the kernels really are
interpreted is read from the kernel objects, not from the environment.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvzap_export.errors import InputError, MissingDependencyError
from kvzap_export.ops import kv_compaction, threshold_compaction
from tests.ops.test_compaction import cases

triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'kvzap-export[gpu]')")

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kvzap_export.kernels import triton_compaction as tk  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
INTERPRETED = isinstance(tk.compaction_kernel_scalars, InterpretedFunction)
DEVICE = "cpu" if INTERPRETED else "cuda"
needs_a_device = pytest.mark.skipif(
    not INTERPRETED and not torch.cuda.is_available(),
    reason="the kernels were compiled for CUDA (TRITON_INTERPRET unset when they were defined) and no GPU is visible")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _same(got, ref):
    return all(g.dtype == r.dtype and torch.equal(g.cpu(), r.cpu()) for g, r in zip(got, ref))


def _same_values(got, ref):
    """Exact equality of float tensors, NaN equal to NaN (the reference's torch.where may change NaN payloads)."""
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.cpu(), r.cpu(), rtol=0, atol=0, equal_nan=True)
    return True


def _neighbours(value: float, dtype: torch.dtype) -> list[float]:
    """``value`` rounded to ``dtype`` and its two neighbours in that dtype (as Python floats)."""
    bits_dtype = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[dtype]
    bits = torch.tensor([value], dtype=dtype).view(bits_dtype)
    near = torch.cat([bits - 1, bits, bits + 1]).view(dtype).float()
    return [x for x in near.tolist() if x == x and abs(x) != float("inf")]


def _edge_thresholds(dtype: torch.dtype, base: float) -> tuple[list[float], list[float]]:
    """Scores on the dtype's grid around ``base`` and thresholds on, between and just off its midpoints.

    ``mid ± 2^-40·|mid|`` rounds to the midpoint in float32, then to even in ``dtype``: a direct
    double → dtype rounding would give the other neighbour (torch rounds double → float32 → dtype).
    """
    grid = _neighbours(base, dtype)
    thresholds = list(grid)
    for lo, hi in zip(grid, grid[1:]):
        mid = (lo + hi) / 2
        thresholds += [mid, mid + abs(mid) * 2**-40, mid - abs(mid) * 2**-40, lo + (hi - lo) / 8]
    return grid, thresholds


EDGE_BASES = [1.0, -3.5, 0.1, 1e-40, 6e-8, 65504.0, 3.0e38, 0.0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_compares_a_python_float_in_the_scores_dtype(dtype):
    """The claim the kernels rely on: ``x < tau`` == ``x.float() < float32(tau) rounded to x's dtype``."""
    distinguishes_rounding = False
    for base in EDGE_BASES:
        grid, thresholds = _edge_thresholds(dtype, base)
        x = torch.tensor(grid + [float("nan"), float("inf"), float("-inf")], dtype=dtype)
        for tau in thresholds + [1e39, -1e39, 65519.99, 65520.0]:
            tau_in_dtype = torch.tensor(tau, dtype=torch.float32).to(dtype).float()
            assert torch.equal(x < tau, x.float() < tau_in_dtype), (dtype, base, tau)
            distinguishes_rounding |= not torch.equal(x < tau, x.double() < tau)
    assert distinguishes_rounding  # the test data does separate "in the dtype" from "in float64"


@needs_a_device
@pytest.mark.parametrize("dtype", DTYPES)
def test_compaction_kernel_at_rounding_edges(dtype):
    for base in EDGE_BASES:
        grid, thresholds = _edge_thresholds(dtype, base)
        row = torch.tensor(grid * 3 + [float("nan"), float("inf"), float("-inf")], dtype=dtype)
        scores = torch.stack([row, row.flip(0)])[None]  # [1, 2, seq]
        lengths = torch.tensor([row.numel()])
        for tau in thresholds:
            ref = threshold_compaction(scores, lengths, tau, 2, 1)
            got = tk.triton_threshold_compaction(scores.to(DEVICE), lengths.to(DEVICE), tau, 2, 1)
            assert _same(got, ref), (dtype, base, tau)


@needs_a_device
@settings(max_examples=40, deadline=None)
@given(cases(), st.sampled_from([(None, None), (16, 16), (16, 32), (32, 128)]), st.sampled_from([torch.int32, torch.int64]))
def test_compaction_kernel_equals_reference(case, tiles, lengths_dtype):
    """Small tiles put several blocks in a chunk and several chunks (programs) in a row."""
    scores, lengths, threshold, window, sink = case
    lengths = lengths.to(lengths_dtype)
    ref = threshold_compaction(scores, lengths, threshold, window, sink)
    block, chunk = tiles
    got = tk.launch_threshold_compaction(scores.to(DEVICE), lengths.to(DEVICE), float(threshold), window, sink,
                                         block=block, chunk=chunk)
    assert _same(got, ref)
    assert _same(tk.triton_threshold_compaction(scores.to(DEVICE), lengths.to(DEVICE), threshold, window, sink), ref)


@needs_a_device
@pytest.mark.parametrize("seq", [tk.BLOCK_T - 1, tk.BLOCK_T, 2 * tk.BLOCK_T + 300, tk.CHUNK_T + 1])
def test_compaction_kernel_with_its_default_tiles(seq):
    gen = torch.Generator().manual_seed(seq)
    scores = torch.randn(2, 2, seq, generator=gen).to(torch.bfloat16)
    lengths = torch.tensor([seq, seq // 3])
    ref = threshold_compaction(scores, lengths, 0.2, 64, 4)
    assert _same(tk.triton_threshold_compaction(scores.to(DEVICE), lengths.to(DEVICE), 0.2, 64, 4), ref)


@needs_a_device
def test_compaction_kernel_empty_shapes():
    for shape in [(0, 2, 5), (2, 0, 5), (2, 3, 0)]:
        scores, lengths = torch.zeros(shape), torch.zeros(shape[0], dtype=torch.int32)
        assert _same(tk.triton_threshold_compaction(scores.to(DEVICE), lengths.to(DEVICE), 0.0, 1),
                     threshold_compaction(scores, lengths, 0.0, 1))


@needs_a_device
@settings(max_examples=20, deadline=None)
@given(cases(max_seq=40), st.sampled_from([1, 24, 64]), st.sampled_from([None, 1, 4]))
def test_kv_move_kernel_equals_reference(case, head_dim, rows):
    scores, lengths, threshold, window, sink = case
    indices = threshold_compaction(scores, lengths, threshold, window, sink).indices
    gen = torch.Generator().manual_seed(int(lengths.sum()))
    shape = (*scores.shape, head_dim)  # 24: not a power of two, masked columns
    keys, values = (torch.randn(shape, generator=gen).to(scores.dtype) for _ in range(2))
    keys[..., 0] = float("nan")
    ref = kv_compaction(keys, values, indices)
    got = tk.launch_kv_compaction(keys.to(DEVICE), values.to(DEVICE), indices.to(DEVICE), rows=rows)
    assert _same_values(got, ref)
    assert _same_values(tk.triton_kv_compaction(keys.to(DEVICE), values.to(DEVICE), indices.to(torch.int64).to(DEVICE)), ref)


@needs_a_device
def test_kv_move_reads_nothing_for_out_of_range_indices():
    keys = torch.arange(24, dtype=torch.float32).reshape(1, 1, 3, 8)
    indices = torch.tensor([[[2, 7, -5]]], dtype=torch.int32)
    k, v = tk.triton_kv_compaction(keys.to(DEVICE), keys.to(DEVICE), indices.to(DEVICE))
    assert torch.equal(k.cpu()[0, 0, 0], keys[0, 0, 2]) and not k.cpu()[0, 0, 1:].any()


@needs_a_device
def test_kernel_rejects_bad_input_with_typed_errors():
    with pytest.raises(InputError, match="lengths has batch"):
        tk.triton_threshold_compaction(torch.zeros(2, 1, 4, device=DEVICE), torch.tensor([1], device=DEVICE), 0.0, 1)
    with pytest.raises(InputError, match="threshold is NaN"):
        tk.triton_threshold_compaction(torch.zeros(1, 1, 4, device=DEVICE), torch.tensor([1], device=DEVICE), float("nan"), 1)
    with pytest.raises(InputError, match="indices must be"):
        tk.triton_kv_compaction(torch.zeros(1, 1, 4, 8, device=DEVICE), torch.zeros(1, 1, 4, 8, device=DEVICE),
                                torch.zeros(1, 1, 3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(InputError, match="Triton"):  # a device the kernels cannot read
        tk.launch_threshold_compaction(torch.zeros(1, 1, 4, device="meta"), torch.zeros(1, dtype=torch.int32), 0.0, 1)
    with pytest.raises(InputError, match="Triton"):
        tk.launch_kv_compaction(*(torch.zeros(1, 1, 4, 8, device="meta"),) * 2, torch.zeros(1, 1, 4, dtype=torch.int32))


def test_without_triton_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setattr(tk, "triton", None)
    with pytest.raises(MissingDependencyError, match="pip install"):
        tk.triton_threshold_compaction(torch.zeros(1, 1, 4), torch.tensor([4]), 0.0, 1)
    with pytest.raises(MissingDependencyError, match="pip install"):
        tk.triton_kv_compaction(torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, dtype=torch.int32))


def test_module_imports_without_triton_and_plugin_needs_tensorrt():
    code = ("import sys; sys.modules['triton'] = None\n"
            "from kvzap_export.errors import MissingDependencyError\n"
            "import kvzap_export.kernels.triton_compaction as tk, kvzap_export.kernels.trt_plugin as tp\n"
            "try:\n    tk.require_triton()\nexcept MissingDependencyError as e:\n    print('triton:', e)\n"
            "sys.modules['tensorrt'] = None\n"
            "try:\n    tp.register_plugin()\nexcept MissingDependencyError as e:\n    print('tensorrt:', e)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("triton: ") and lines[1].startswith("tensorrt: ")


def test_custom_ops_fall_back_to_the_reference_on_cpu_and_compile():
    from kvzap_export.kernels import torch_ops

    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(2, 3, 40, generator=gen).to(torch.bfloat16)
    scores[0, 1, 5] = float("nan")
    lengths = torch.tensor([40, 17])
    ref = threshold_compaction(scores, lengths, 0.1, 8, 2)
    assert _same(torch_ops.threshold_compaction(scores, lengths, 0.1, 8, 2), ref)
    keys = torch.randn(2, 3, 40, 16, generator=gen)
    assert _same(torch_ops.kv_compaction(keys, -keys, ref.indices), kv_compaction(keys, -keys, ref.indices))

    def step(s, n, k, v):
        keep, counts, indices = torch.ops.kvzap.threshold_compaction(s, n, 0.1, 8, 2)
        return (keep, counts, indices, *torch.ops.kvzap.kv_compaction(k, v, indices))

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = compiled(scores, lengths, keys, -keys)
    assert _same(got[:3], ref) and _same(got[3:], kv_compaction(keys, -keys, ref.indices))


PTXAS = shutil.which("ptxas")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("arch", [80, 90])
def test_aot_compiles_to_ptx_without_a_gpu(dtype, arch, tmp_path):
    """What the TensorRT QDP ``aot_impl`` returns: PTX of the same kernel with exactly TensorRT's parameters; the
    sm_80 PTX the plugin ships assembles for every later architecture too."""
    if INTERPRETED:
        pytest.skip("the interpreter replaces triton.jit kernels; AOT compilation runs in a process without "
                    "TRITON_INTERPRET (tests/kernels/test_aot_subprocess.py)")
    from kvzap_export.kernels.trt_plugin import KERNEL_PARAMS, PTX_ARCH, compile_compaction_kernel, ptx_for_tensorrt

    compiled = compile_compaction_kernel(dtype, sink=0, arch=arch)
    ptx = ptx_for_tensorrt(compiled)
    name = compiled.metadata.name
    assert f".target sm_{arch}" in ptx and f".entry {name}(" in ptx and ".version 8.0" in ptx
    header = ptx[ptx.index(f".entry {name}("):]
    header = header[: header.index(")")]
    assert header.count(".param") == len(KERNEL_PARAMS) and f"{name}_param_{len(KERNEL_PARAMS)}" not in header
    assert compiled.metadata.num_warps * 32 == tk.COMPACTION_WARPS * 32
    if PTXAS:  # the edited PTX still assembles (ptxas from nvcc)
        (tmp_path / "k.ptx").write_text(ptx)
        targets = [f"sm_{arch}a" if arch == 90 else f"sm_{arch}"]
        if arch == PTX_ARCH:  # what the AOT plugin ships: it must compile forward for every later GPU
            targets += ["sm_86", "sm_89", "sm_90", "sm_100", "sm_120"]
        for target in targets:
            done = subprocess.run([PTXAS, f"-arch={target}", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                                  capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, f"{target}: {done.stderr}"


_COMPILE_ALL = """
import triton
from triton.backends.compiler import GPUTarget
from kvzap_export.kernels import triton_compaction as tk
for arch in (80, 90):
    for dt in ("fp32", "fp16", "bf16"):
        sig = {"scores_ptr": f"*{dt}", "lengths_ptr": "*i64", "threshold": "fp32", "window": "i32", "seq": "i32",
               "heads": "i32", "keep_ptr": "*i8", "counts_ptr": "*i32", "indices_ptr": "*i32"}
        triton.compile(triton.compiler.ASTSource(tk.compaction_kernel_scalars, sig,
                                                 constexprs={"SINK": 4, "BLOCK": tk.BLOCK_T, "CHUNK": tk.CHUNK_T}),
                       target=GPUTarget("cuda", arch, 32), options={"num_warps": tk.COMPACTION_WARPS})
        sig = {"keys_ptr": f"*{dt}", "values_ptr": f"*{dt}", "indices_ptr": "*i32", "keys_out_ptr": f"*{dt}",
               "values_out_ptr": f"*{dt}", "seq": "i32", "blocks_per_row": "i32"}
        aligned = {(i,): [["tt.divisibility", 16]] for i in range(5)}
        move = triton.compile(triton.compiler.ASTSource(tk.kv_move_kernel, sig, constexprs={"HEAD_DIM": 128, "BLOCK_D": 128,
                              "ROWS": tk.move_rows_per_program(128, 2)}, attrs=aligned),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": tk.MOVE_WARPS})
        assert "ld.global.v4" in move.asm["ptx"], "the K/V move is not vectorized"
print("ok")
"""


@pytest.mark.slow
def test_torch_path_kernels_compile_for_sm80_and_sm90():
    """The kernels the torch ops launch compile with the real Triton compiler (no GPU needed), the move vectorized."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_ALL], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


# --- real kernels on a GPU -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_torch_reference_compares_like_the_cpu(dtype):
    """The rounding claim holds for torch's CUDA comparison too, so CPU and CUDA references agree."""
    for base in EDGE_BASES:
        grid, thresholds = _edge_thresholds(dtype, base)
        x = torch.tensor(grid, dtype=dtype)
        for tau in thresholds:
            assert torch.equal((x.cuda() < tau).cpu(), x < tau), (dtype, base, tau)


@pytest.mark.gpu
@pytest.mark.parametrize("seq", [4096, 131072])
def test_gpu_kernels_at_llama_shapes(seq):
    if INTERPRETED:
        pytest.skip("kernels were defined under TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(seq)
    scores = torch.randn(2, 8, seq, generator=gen).to(torch.bfloat16)
    scores[..., ::97] = float("nan")
    lengths = torch.tensor([seq, seq - 1000])
    ref = threshold_compaction(scores, lengths, 0.3, 128, 4)
    got = tk.triton_threshold_compaction(scores.cuda(), lengths.cuda(), 0.3, 128, 4)
    assert _same(got, ref)
    assert _same(got, threshold_compaction(scores.cuda(), lengths.cuda(), 0.3, 128, 4))  # CUDA reference too
    keys = torch.randn(2, 8, seq, 128, device="cuda", dtype=torch.bfloat16)
    values = torch.randn(2, 8, seq, 128, device="cuda", dtype=torch.bfloat16)
    assert _same(tk.triton_kv_compaction(keys, values, got.indices), kv_compaction(keys, values, got.indices))


@pytest.mark.gpu
def test_gpu_custom_ops_run_the_kernels_compile_and_capture_in_a_cuda_graph():
    if INTERPRETED:
        pytest.skip("kernels were defined under TRITON_INTERPRET=1")
    from kvzap_export.kernels import torch_ops

    gen = torch.Generator().manual_seed(7)
    scores = torch.randn(2, 8, 3000, generator=gen).to(torch.bfloat16).cuda()
    lengths = torch.tensor([3000, 1234], device="cuda")
    keys = torch.randn(2, 8, 3000, 64, generator=gen).cuda()
    ref = threshold_compaction(scores, lengths, 0.0, 128)
    ref_kv = kv_compaction(keys, -keys, ref.indices)
    assert _same(torch_ops.threshold_compaction(scores, lengths, 0.0, 128), ref)
    assert _same(torch_ops.kv_compaction(keys, -keys, ref.indices), ref_kv)

    def step(s, n, k, v):
        keep, counts, indices = torch.ops.kvzap.threshold_compaction(s, n, 0.0, 128, 0)
        return (keep, counts, indices, *torch.ops.kvzap.kv_compaction(k, v, indices))

    got = torch.compile(step, backend="aot_eager", fullgraph=True)(scores, lengths, keys, -keys)
    assert _same(got[:3], ref) and _same(got[3:], ref_kv)
    step(scores, lengths, keys, -keys)  # warm up (compile the kernels) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(scores, lengths, keys, -keys)
    graph.replay()
    torch.cuda.synchronize()
    assert _same(captured[:3], ref) and _same(captured[3:], ref_kv)
