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

from kvzap_export.errors import InputError
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


# ---- the decision kernel's tiling (plugins/src/compaction.cu) -------------------------------------------------
THREADS, ITEMS, WARPS, TARGET_BLOCKS, FILL_TILES = 256, 16, 8, 384, 8  # compaction.cu's kThreads, kItems, ...
STEP = THREADS * ITEMS


def _tiling(rows: int, seq: int) -> tuple[int, int]:
    """compaction.cu's tiling(): (tiles per row, positions per tile), in Python."""
    steps = max(-(-seq // STEP), 1)
    want = 1 if rows >= TARGET_BLOCKS else -(-TARGET_BLOCKS // rows)
    per_tile = -(-steps // min(want, steps))
    return -(-steps // per_tile), per_tile * STEP


@needs_nvcc
def test_the_decision_launch_splits_long_rows_over_enough_blocks_to_fill_an_h100(nvcc_library):
    """Host arithmetic of the library, no GPU: batch 1 x 8 KV heads x 128k once ran on 8 blocks (132 SMs)."""
    kernels = CudaKernels(nvcc_library)
    blocks, span = kernels.threshold_compaction_grid(1, 8, 131072)
    assert blocks >= 132 and blocks % 8 == 0 and (blocks // 8) * span >= 131072 > (blocks // 8 - 1) * span
    assert kernels.threshold_compaction_grid(1, 1, 1) == (1, STEP)  # small rows: one block each
    assert kernels.threshold_compaction_grid(2, 3, 0) == (6, STEP)  # empty rows still write their counts
    assert kernels.threshold_compaction_grid(64, 8, 131072) == (512, 131072)  # many rows: one tile each
    shapes = [(1, 8, 4096), (1, 8, 32768), (3, 5, 70001), (4, 8, 131072), (1, 1, 600_000), (25, 8, 9000), (7, 3, 4097)]
    for batch, heads, seq in shapes:
        tiles, span = _tiling(batch * heads, seq)
        assert kernels.threshold_compaction_grid(batch, heads, seq) == (batch * heads * tiles, span)
    for bad in ((0, 8, 10), (1, 0, 10), (1, 8, -1), (1, 8, 2**31 - 1)):
        with pytest.raises(InputError, match="cannot launch"):
            kernels.threshold_compaction_grid(*bad)


def _emulate_decisions(scores, lengths, tau, window, sink) -> Compaction:
    """compaction.cu's decision kernel block by block in torch: each tile recounts the rows' kept positions before
    it, walks its steps in the striped layout (position = step + item * 256 + warp * 32 + lane), scans the 128
    (item, warp) group counts in position order and places each kept position at count + group prefix + kept lanes
    below it; the last FILL_TILES tiles count the rest of the row too and split the -1 tail. Asserts every keep
    entry and index slot is written once (no two blocks write one address). A model of the kernel's arithmetic,
    not the CUDA code itself."""
    batch, heads, seq = scores.shape
    rows = batch * heads
    tiles, span = _tiling(rows, seq)
    tau = float(torch.tensor(tau, dtype=torch.float32).to(scores.dtype))
    flat, length, pos = scores.reshape(rows, seq).float(), lengths.repeat_interleave(heads)[:, None], torch.arange(seq)
    rule = (pos < length) & ((pos >= length - window) | (pos < sink) | ~(flat < tau))
    keep, counts = torch.zeros(rows, seq, dtype=torch.bool), torch.full((rows,), -7, dtype=torch.int32)
    indices = torch.full((rows, seq), -7, dtype=torch.int32)
    keep_writes, slot_writes = torch.zeros(rows, seq, dtype=torch.int32), torch.zeros(rows, seq, dtype=torch.int32)
    layout = (torch.arange(ITEMS)[:, None, None] * THREADS + torch.arange(WARPS)[None, :, None] * 32
              + torch.arange(32)[None, None, :])  # [item, warp, lane]
    fill_tiles = min(tiles, FILL_TILES)
    for tile in range(tiles):
        begin, end = min(tile * span, seq), min(tile * span + span, seq)
        after = rule[:, end:].sum(1)  # what a fill tile counts after itself
        # Kept before the tile, as the kernel counts [0, end = min(begin, length)): positions below lo = min(sink,
        # end) and from hi = window start clamped to [lo, end] by arithmetic, the scores of [lo, hi) not below tau.
        end_ = length[:, 0].clamp(max=begin)
        lo = end_.clamp(max=sink)
        hi = torch.minimum(torch.maximum(length[:, 0] - window, lo), end_)
        count = lo + (end_ - hi) + ((pos >= lo[:, None]) & (pos < hi[:, None]) & ~(flat < tau)).sum(1)
        assert torch.equal(count, rule[:, :begin].sum(1))
        for step in range(begin, end, STEP):
            p = step + layout
            valid = p < end
            kept = rule[:, p.clamp(max=seq - 1)] & valid
            keep[:, p[valid]] = kept[:, valid]
            keep_writes[:, p[valid]] += 1
            group = kept.sum(-1).reshape(rows, ITEMS * WARPS)
            prefix = (group.cumsum(1) - group).reshape(rows, ITEMS, WARPS, 1)
            slot = count[:, None, None, None] + prefix + kept.cumsum(-1) - kept.int()
            r, i, w, lane = kept.nonzero(as_tuple=True)
            indices[r, slot[r, i, w, lane]] = p[i, w, lane].int()
            slot_writes.index_put_((r, slot[r, i, w, lane]), torch.ones_like(r, dtype=torch.int32), accumulate=True)
            count = count + group.sum(1)
        part = tile - (tiles - fill_tiles)
        if part >= 0:  # a fill tile: its share of the slots [total, seq)
            total = count + after
            share = (seq - total + fill_tiles - 1) // fill_tiles
            start = (total + part * share).clamp(max=seq)
            mine = (pos >= start[:, None]) & (pos < (start + share)[:, None])
            indices[mine] = -1
            slot_writes += mine.int()
            counts = total.int()
    assert bool((keep_writes == 1).all()) and bool((slot_writes == 1).all())
    return Compaction(keep.view(batch, heads, seq), counts.view(batch, heads), indices.view(batch, heads, seq))


@pytest.mark.parametrize("shape, lengths", [((3, 5, 9000), [9000, 4096, 0]), ((40, 8, 9000), None),
                                            ((1, 2, 40000), [37000]), ((2, 1, 1), [1, 0]), ((1, 2, 0), [0])])
def test_the_tiling_arithmetic_equals_the_reference_on_the_cpu(shape, lengths):
    """Tiles: 40 x 8 rows two of two steps, 3 x 5 three of one step, 1 x 2 x 40000 ten (eight of them fill tiles);
    lengths cross tile bounds."""
    gen = torch.Generator().manual_seed(4)
    for dtype, tau, window, sink in ((torch.bfloat16, -0.3, 128, 4), (torch.float32, 0.5, 5000, 0),
                                     (torch.float16, -1e30, 0, 0), (torch.bfloat16, 1e30, 7, 3)):
        scores = (torch.randn(*shape, generator=gen) - 0.3).to(dtype)
        scores[..., ::97] = float("nan")
        lens = torch.tensor(lengths) if lengths else torch.randint(0, shape[2] + 1, (shape[0],), generator=gen)
        ref = threshold_compaction(scores, lens, tau, window, sink)
        assert all(torch.equal(g, r) for g, r in zip(_emulate_decisions(scores, lens, tau, window, sink), ref))


def test_the_recount_split_reads_each_position_once_with_aligned_vectors():
    """countNotBelow() and fillNone(): a scalar head up to the first 16-byte boundary, whole vectors, a scalar tail."""
    for elem in (2, 4):
        vec = 16 // elem
        for misaligned in range(vec):  # the row's first element's offset from a 16-byte boundary, in elements
            for end in (0, 1, vec - 1, vec, vec + 1, 4096, 4099, 70001):
                head = min((vec - misaligned) % vec, end)
                vectors = (end - head) // vec
                assert vectors == 0 or (misaligned + head) % vec == 0
                read = [*range(head), *(head + v * vec + e for v in range(vectors) for e in range(vec)),
                        *range(head + vectors * vec, end)]
                assert read == list(range(end))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_decisions_over_many_blocks_equal_the_reference_at_128k_and_odd_rows(nvcc_library, dtype):
    """Batch 1 x 8 heads x 131072 (the benchmark shape, 256 blocks) and 3 x 5 x 70001 (tiles end mid-row, rows
    start off 16-byte boundaries); lengths on and off tile bounds, NaN, subnormal and -0.0 scores, all or nothing
    kept; then a CUDA graph of the launcher replayed with another threshold (read on the device at replay)."""
    lib = CudaKernels(nvcc_library)
    assert lib.threshold_compaction_grid(1, 8, 131072)[0] >= 132
    gen = torch.Generator().manual_seed(5)
    cases = [((1, 8, 131072), [131072], 0.0, 128, 0), ((1, 8, 131072), [100003], -0.5, 1000, 4),
             ((3, 5, 70001), [70001, 8192, 4097], 0.3, 7, 3), ((3, 5, 70001), [4095, 0, 69999], -1e30, 0, 0),
             ((3, 5, 70001), [70001, 12289, 1], 1e30, 5, 2)]
    for shape, lengths, tau, window, sink in cases:
        scores = torch.randn(*shape, generator=gen).to(dtype)
        scores[..., 3::101] = float("nan")
        scores[..., 7::211], scores[..., 11::223] = -1e-40, -0.0  # subnormal: below tau = 0; -0.0: not below
        lengths = torch.tensor(lengths)
        ref = threshold_compaction(scores, lengths, tau, window, sink)
        for keep_dtype in (torch.bool, torch.int32):
            got = _compaction(lib, scores.cuda(), lengths, tau, window, sink, keep_dtype)
            assert all(torch.equal(g, r) for g, r in zip(got, ref)), (shape, lengths.tolist(), tau, keep_dtype)
    scores = torch.randn(1, 8, 131072, generator=gen).to(dtype)
    gpu, lengths = scores.cuda(), torch.tensor([131000], dtype=torch.int32, device="cuda")
    tau_t, win_t = torch.tensor(0.0, device="cuda"), torch.tensor(64, dtype=torch.int32, device="cuda")
    out = Compaction(torch.empty(1, 8, 131072, dtype=torch.bool, device="cuda"),
                     torch.empty(1, 8, dtype=torch.int32, device="cuda"),
                     torch.empty(1, 8, 131072, dtype=torch.int32, device="cuda"))
    lib.launch_threshold_compaction(gpu, lengths, tau_t, win_t, 0, torch.bool, out=out)  # loads the kernel first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lib.launch_threshold_compaction(gpu, lengths, tau_t, win_t, 0, torch.bool, out=out)
    tau_t.fill_(0.7)
    out.indices.fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    ref = threshold_compaction(scores, lengths.cpu(), 0.7, 64)
    assert all(torch.equal(g.cpu(), r) for g, r in zip(out, ref))
