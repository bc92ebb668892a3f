"""The Triton kernels equal the reference exactly (CPU: Triton's interpreter; GPU: the real kernels)."""

import os

import pytest
import torch
from hypothesis import given, settings

from kvzap_export.ops import kv_compaction, threshold_compaction
from tests.ops.test_compaction import cases

triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'kvzap-export[gpu]')")

from kvzap_export.kernels import triton_compaction  # noqa: E402
from kvzap_export.kernels.triton_compaction import triton_kv_compaction, triton_threshold_compaction  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
needs_a_device = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(),
                                    reason="neither a CUDA GPU nor TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")


def _same(got, ref):
    return all(torch.equal(g.cpu(), r) for g, r in zip(got, ref))


@needs_a_device
@settings(max_examples=40, deadline=None)
@given(cases())
def test_compaction_kernel_equals_reference(case):
    scores, lengths, threshold, window, sink = case
    ref = threshold_compaction(scores, lengths, threshold, window, sink)
    got = triton_threshold_compaction(scores.to(DEVICE), lengths.to(DEVICE), threshold, window, sink)
    assert got.keep.dtype == torch.bool and got.counts.dtype == torch.int32 and got.indices.dtype == torch.int32
    assert _same(got, ref)


@needs_a_device
@pytest.mark.parametrize("seq", [1023, 1024, 2500])  # one block, exactly a block, several blocks
def test_compaction_kernel_across_blocks(seq):
    gen = torch.Generator().manual_seed(seq)
    scores = torch.randn(2, 3, seq, generator=gen)
    lengths = torch.tensor([seq, seq // 3])
    ref = threshold_compaction(scores, lengths, 0.2, 64, 4)
    assert _same(triton_threshold_compaction(scores.to(DEVICE), lengths.to(DEVICE), 0.2, 64, 4), ref)


@needs_a_device
@settings(max_examples=15, deadline=None)
@given(cases(max_seq=40))
def test_kv_move_kernel_equals_reference(case):
    scores, lengths, threshold, window, sink = case
    indices = threshold_compaction(scores, lengths, threshold, window, sink).indices
    gen = torch.Generator().manual_seed(int(lengths.sum()))
    shape = (*scores.shape, 24)  # head_dim not a power of two: masked columns
    keys, values = (torch.randn(shape, generator=gen).to(scores.dtype) for _ in range(2))
    ref = kv_compaction(keys, values, indices)
    assert _same(triton_kv_compaction(keys.to(DEVICE), values.to(DEVICE), indices.to(DEVICE)), ref)


@needs_a_device
def test_kernel_rejects_bad_input_with_typed_errors():
    from kvzap_export.errors import InputError

    with pytest.raises(InputError, match="lengths has batch"):
        triton_threshold_compaction(torch.zeros(2, 1, 4, device=DEVICE), torch.tensor([1], device=DEVICE), 0.0, 1)
    with pytest.raises(InputError, match="indices must be"):
        triton_kv_compaction(torch.zeros(1, 1, 4, 8, device=DEVICE), torch.zeros(1, 1, 4, 8, device=DEVICE),
                             torch.zeros(1, 1, 3, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("arch", [80, 90])
def test_aot_compiles_to_ptx_without_a_gpu(dtype, arch):
    """What the TensorRT QDP ``aot_impl`` returns: PTX of the same kernel, for sm_80 and sm_90."""
    if INTERPRETED:
        pytest.skip("the interpreter replaces triton.jit kernels; AOT compilation runs in a process without TRITON_INTERPRET")
    from kvzap_export.kernels.trt_plugin import compile_compaction_kernel

    compiled = compile_compaction_kernel(dtype, sink=0, arch=arch)
    ptx = compiled.asm["ptx"]
    assert f".target sm_{arch}" in ptx and f".entry {compiled.metadata.name}" in ptx
    assert compiled.metadata.num_warps * 32 > 0 and compiled.asm["cubin"]
    assert triton_compaction.BLOCK_T == 1024
