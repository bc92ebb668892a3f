"""plugins/src/: on a GPU the CUDA kernels (threshold compaction, K/V move) equal the PyTorch reference exactly, over
every dtype, long sequences, odd rows and out-of-range indices; the decision kernel's tiling (the host arithmetic of
the library, no GPU) fills an H100 and, emulated in Python, equals the reference on the CPU."""

import pytest
import torch

from kvzap_export.errors import InputError
from kvzap_export.kernels.cuda_lib import CudaKernels
from kvzap_export.ops import Compaction, kv_compaction, threshold_compaction


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
