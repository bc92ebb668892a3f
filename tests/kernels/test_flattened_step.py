"""Every layer's flattened decode rows laid out at once from the store's row tables (``kernels/flattened_step.py``).

SGLang's decode kernel runs in Triton's CPU interpreter here (float32 and float16), compared per layer with
``ragged_attention.ragged_decode_attention``, the float32 formula written independently of every kernel, over the
same entries read back from the tables. The id copy runs both ways: the torch scatter and our Triton kernel (in the
interpreter). Without SGLang's kernel file the tests skip, saying so (tests/conftest.py: sglang_kernel_source).
"""

from __future__ import annotations

import pytest
import torch

from kvzap_export.errors import InputError
from kvzap_export.kernels.flattened_step import FlattenedStep
from kvzap_export.kernels.ragged_attention import ragged_decode_attention

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU the kernels run compiled (scripts/gpu_check.sh)
# on a GPU, SGLang's grouped kernel multiplies float32 through tl.dot in TF32 (Triton's default)
F32 = dict(atol=1e-5, rtol=1e-5) if DEVICE == "cpu" else dict(atol=5e-3, rtol=5e-3)
TOL = {torch.float32: F32, torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.fixture(scope="module")
def kernels(sglang_kernels):
    return sglang_kernels


def tables(lengths, width, entries, seed=0):
    """Row tables (a row's ids are distinct; rows may share ids, so a step's total is sized past ``entries``) [S, L, H, width] of distinct random entry ids per row (padding: other valid ids), lengths [S, L, H]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths, dtype=torch.int32)
    ids = torch.randint(0, entries, (*lengths.shape, width), generator=g, dtype=torch.int32)
    for index in torch.cartesian_prod(*[torch.arange(n) for n in lengths.shape]).tolist():
        n = int(lengths[tuple(index)])
        ids[tuple(index)][:n] = torch.randperm(entries, generator=g)[:n].to(torch.int32)
    return ids, lengths


# table slots [S=4][L=3][H=2]: rows of different lengths, empty heads, a slot whose every head is empty
LENGTHS = [[[5, 0], [70, 33], [1, 64]],
           [[0, 0], [0, 0], [0, 0]],
           [[17, 90], [3, 0], [100, 2]],
           [[40, 41], [42, 0], [9, 9]]]


@pytest.mark.parametrize("buffer", [2000, 300, 150], ids=["step-fits", "layer-fits", "layer-past"])
@pytest.mark.parametrize("use_triton", [False, True], ids=["torch-copy", "triton-copy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_every_layer_equals_the_formula_over_the_tables_entries(kernels, dtype, use_triton, buffer):
    """Slots in any order, padding rows (-1), empty heads and an all-empty request; each layer's output equals the
    formula over that layer's entries, and padding rows give zeros. The step's 526 ids laid out at once where the
    buffer holds them (``buffer`` entries), else each layer's before its attention (at most 193): into the buffer,
    or past it into one layer's worth of ids of its own (rows sharing a cached prefix, eager steps)."""
    L, H, group, D, entries = 3, 2, 4, 16, 400
    if DEVICE == "cuda" and not use_triton:
        pytest.skip("the torch copy is the CPU's path")
    ids, lengths = tables(LENGTHS, 128, entries)
    g = torch.Generator().manual_seed(1)
    k = torch.randn(entries + 1, D, generator=g).to(DEVICE, dtype)
    v = torch.randn(entries + 1, D, generator=g).to(DEVICE, dtype)
    step = FlattenedStep(L, 6, H, group, D, buffer, dtype=dtype, device=DEVICE, max_kv_splits=4, target_programs=32,
                         min_chunk=8, kernels=kernels, use_triton=use_triton)
    pointers = {name: t.data_ptr() for name, t in step.buffers().items()}
    slots = torch.tensor([2, 0, -1, 3, 1])
    held = lengths[slots.clamp(min=0)] * (slots >= 0)[:, None, None]
    total, per_layer = int(held.sum()), int(held.sum((0, 2)).max())
    assert (total, per_layer) == (526, 193)
    step.fill(ids.to(DEVICE), lengths.to(DEVICE), slots.to(DEVICE), width=int(lengths.max()), ids=total,
              layer_ids=per_layer)
    assert (step.indices is step.kv_indices) == (buffer > per_layer) and step.indices.numel() <= max(buffer, per_layer) + 1
    assert {name: t.data_ptr() for name, t in step.buffers().items()} == pointers
    for layer in range(L):
        q = torch.randn(5, H * group, D, generator=g).to(DEVICE, dtype)
        out = torch.full((5, H * group, D), float("nan"), dtype=dtype, device=DEVICE)
        got = step.attend(layer, q, k, v, 0.25, out)
        real = slots.clamp(min=0)
        layer_lengths = lengths[real, layer] * (slots >= 0)[:, None]
        want = ragged_decode_attention(q, k, v, ids[real, layer].to(DEVICE), layer_lengths.to(DEVICE), 0.25)
        assert got.data_ptr() == out.data_ptr()
        torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
        assert not got[2].any() and not got[4].any()  # the padding row and the all-empty request
    if buffer < total:  # laid out layer by layer: the last layer let its ids and tables go; a further attend is refused
        assert step._by_layer is None and step.indices is step.kv_indices
        with pytest.raises(RuntimeError, match="fill the next step first"):
            step.attend(0, q, k, v, 0.25, out)
        step.fill(ids.to(DEVICE), lengths.to(DEVICE), slots.to(DEVICE), width=int(lengths.max()), ids=total,
                  layer_ids=per_layer)  # the next fill attends again
        assert step.attend(0, q, k, v, 0.25, out).data_ptr() == out.data_ptr()


def test_a_small_step_runs_more_splits_in_the_same_buffers(kernels):
    """``small_batch_splits``: a step of at most SMALL_BATCH requests spreads each row over up to that many splits
    (the partial results viewed from the same flat buffers), a larger step keeps ``max_kv_splits``; both equal the
    formula."""
    L, H, group, D, entries = 3, 2, 4, 16, 400
    ids, lengths = tables(LENGTHS, 128, entries)
    g = torch.Generator().manual_seed(5)
    k = torch.randn(entries + 1, D, generator=g).to(DEVICE)
    v = torch.randn(entries + 1, D, generator=g).to(DEVICE)
    step = FlattenedStep(L, 6, H, group, D, 2000, dtype=torch.float32, device=DEVICE, max_kv_splits=2, target_programs=64,
                         min_chunk=8, kernels=kernels, small_batch_splits=8)
    assert step.split_rows == 4 * H * 8 and (step.splits_for(4 * H), step.splits_for(5 * H)) == (8, 2)
    wide = FlattenedStep(L, 40, H, group, D, 2000, device=DEVICE, max_kv_splits=2, kernels=kernels, small_batch_splits=8)
    assert wide.split_rows == 40 * H * 2 and (wide.splits_for(4 * H), wide.splits_for(5 * H)) == (8, 2)  # 5 requests fit, but are not small
    pointers = {name: t.data_ptr() for name, t in step.buffers().items()}
    for slots, cap in (([2, 3], 8), ([2, 0, -1, 3, 1], 2)):
        step.fill(ids.to(DEVICE), lengths.to(DEVICE), torch.tensor(slots).to(DEVICE), width=int(lengths.max()))
        R = len(slots) * H
        assert int(step.num_kv_splits[: L * R].max()) == cap  # the long rows reach the cap
        for layer in range(L):
            q = torch.randn(len(slots), H * group, D, generator=g).to(DEVICE)
            got = step.attend(layer, q, k, v, 0.25, torch.empty_like(q))
            real = torch.tensor(slots).clamp(min=0)
            layer_lengths = lengths[real, layer] * (torch.tensor(slots) >= 0)[:, None]
            want = ragged_decode_attention(q, k, v, ids[real, layer].to(DEVICE), layer_lengths.to(DEVICE), 0.25)
            torch.testing.assert_close(got, want, **F32)
    assert {name: t.data_ptr() for name, t in step.buffers().items()} == pointers


def test_the_layout_reads_offsets_per_layer_and_splits_per_layer_total():
    """No kernel needed: indptr is one running sum over (layer, request, head); each layer's split chunk follows its
    own total; the ids land at their rows' offsets (both copies)."""
    L, H, entries = 3, 2, 400
    ids, lengths = tables(LENGTHS, 128, entries)
    slots = torch.tensor([3, 2])
    layouts = []
    for use_triton in (False, True) if DEVICE == "cpu" else (True,):
        step = FlattenedStep(L, 2, H, 1, 8, 2000, dtype=torch.float32, device=DEVICE, max_kv_splits=8,
                             target_programs=4, min_chunk=8, kernels=object(), use_triton=use_triton)
        step.fill(ids.to(DEVICE), lengths.to(DEVICE), slots.to(DEVICE), width=128)
        layouts.append(step)
    for step in layouts:
        lens = lengths[slots].permute(1, 0, 2).reshape(-1)
        assert step.kv_indptr[1: lens.numel() + 1].tolist() == torch.cumsum(lens, 0).tolist()
        for r, (layer, b, h) in enumerate((l_, b_, h_) for l_ in range(L) for b_ in range(2) for h_ in range(H)):
            start, n = int(step.kv_indptr[r]), int(lens[r])
            assert step.kv_indices[start: start + n].tolist() == ids[slots[b], layer, h, :n].tolist()
        for layer in range(L):
            layer_lens = lengths[slots, layer].reshape(-1)
            chunk = max(8, -(-int(layer_lens.sum()) // 4))
            want = [min(8, max(1, -(-int(n) // chunk))) for n in layer_lens]
            assert step.num_kv_splits[layer * 4: (layer + 1) * 4].tolist() == want
            assert step.empty[layer * 4: (layer + 1) * 4].tolist() == [int(n) == 0 for n in layer_lens]


def test_fills_keep_every_buffer_in_place_and_refuse_oversized_steps():
    ids, lengths = tables(LENGTHS, 128, 400)
    step = FlattenedStep(3, 4, 2, 1, 8, 2000, dtype=torch.float32, device="cpu", kernels=object())
    pointers = {name: t.data_ptr() for name, t in step.buffers().items()}
    for slots in ([0], [3, 2, 1, 0], [-1, 2]):
        step.fill(ids, lengths, torch.tensor(slots), width=128)
    assert {name: t.data_ptr() for name, t in step.buffers().items()} == pointers
    # a step laid out layer by layer needs int32 offsets for one layer's ids only (the running sum is per layer)
    step.fill(ids, lengths, torch.tensor([3, 2]), width=128, ids=2**31, layer_ids=193)
    assert step._by_layer is not None and step.indices is step.kv_indices
    with pytest.raises(InputError, match="a layer of 2147483548 entry ids does not fit"):
        step.fill(ids, lengths, torch.tensor([3, 2]), width=128, ids=2**32, layer_ids=2**31 - 100)
    with pytest.raises(InputError, match="5 requests, the buffers hold 1 to 4"):
        step.fill(ids, lengths, torch.zeros(5, dtype=torch.int64), width=8)
    with pytest.raises(InputError, match="tables"):
        step.fill(ids[:, :2], lengths[:, :2], torch.zeros(1, dtype=torch.int64), width=8)
