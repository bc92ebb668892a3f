"""kvzap_export.bench.ragged_step (one decoder layer's decode step, dense vs ragged, as
scripts/bench_ragged_decode.py times it) on CPU tensors in float32.

The layouts, the dense and the ragged step (attention through the torch path of ``ragged_attention``, and through
SGLang's kernel in Triton's interpreter where its file is found), the step's bookkeeping against a model written with
Python lists, and the state's copies keeping their buffers. CUDA graphs, timings and bf16 are not exercised here
(tests/kernels/test_bench_ragged_decode_script.py runs the script's sections).
"""

from __future__ import annotations

import os

import pytest
import torch

from kvzap_export.bench.ragged_step import (WINDOW, Layer, RaggedState, dense_step, kept_lengths, pool_layout,
                                            ragged_step)
from kvzap_export.kernels.ragged_attention import decode_attention, ragged_decode_attention

INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="runs SGLang's kernel on CPU tensors: needs Triton's interpreter (no GPU)")
SMALL = dict(hidden=64, q_heads=8, kv_heads=2, head_dim=16, ffn=96, surrogate_hidden=32, dtype=torch.float32,
             device="cpu")


def state(lengths, seed=0, spare=40):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths, dtype=torch.int32)
    ids, total = pool_layout(lengths, int(lengths.max()), g)
    return RaggedState(lengths, ids, total, 16, torch.float32, g, spare_steps=spare)


def test_layouts_give_each_head_its_own_shuffled_entries():
    g = torch.Generator().manual_seed(0)
    lengths = kept_lengths(16, 8, 4096, 0.7, g)
    assert lengths.dtype == torch.int32 and lengths.shape == (16, 8)
    assert int(lengths.min()) >= round(0.75 * 0.3 * 4096) and int(lengths.max()) <= round(1.25 * 0.3 * 4096)
    ids, total = pool_layout(lengths, int(lengths.max()) + 3, g)
    held = torch.arange(ids.shape[-1]) < lengths[..., None]
    assert total == int(lengths.sum()) and torch.equal(ids[held].sort().values, torch.arange(total, dtype=torch.int32))
    assert bool((ids[~held] == 0).all())
    assert not torch.equal(ids[held], torch.arange(total, dtype=torch.int32))  # shuffled, not contiguous


def test_ragged_step_equals_the_dense_step_over_the_same_entries():
    """Every head holding L entries (shuffled in the pool): the ragged step's output equals the dense step's over a
    cache of those entries plus the new token (attention sees the token before any decision)."""
    layer = Layer(**SMALL)
    st = state([[150, 150], [150, 150], [150, 150]])
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    held = st.ids[..., :150].long()
    k_cache = torch.cat([st.k[held], torch.zeros(3, 2, 1, 16)], 2)
    v_cache = torch.cat([st.v[held], torch.zeros(3, 2, 1, 16)], 2)
    want = dense_step(layer, k_cache, v_cache, x)
    for attend in (decode_attention, ragged_decode_attention):
        got = ragged_step(layer, st.clone(), x, attend, tau=0.0)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_ragged_step_bookkeeping_follows_a_list_model():
    """30 steps: each head's row gets the token's entry, the entry leaving the 128-token window is removed when its
    score is below tau; every entry id is in exactly one place (a row, the free stack, the next step's ids)."""
    layer = Layer(**SMALL)
    st = state([[129, 200], [140, 131]], spare=40)
    E = st.k.shape[0]
    rows = [[st.ids[b, h, : st.lengths[b, h]].tolist() for h in range(2)] for b in range(2)]
    g = torch.Generator().manual_seed(2)
    evicted = 0
    for _ in range(30):
        fresh = st.fresh.clone()
        ragged_step(layer, st, torch.randn(2, 64, generator=g), decode_attention, tau=0.0)
        for b in range(2):
            for h in range(2):
                row = rows[b][h]
                row.append(int(fresh[b, h]))
                if len(row) >= WINDOW + 1 and float(st.scores[row[len(row) - WINDOW - 1]]) < 0.0:
                    del row[len(row) - WINDOW - 1]
                    evicted += 1
                assert st.ids[b, h, : st.lengths[b, h]].tolist() == row
        places = [i for r in rows for row in r for i in row] + st.free[: int(st.top)].tolist() + st.fresh.flatten().tolist()
        assert sorted(places) == list(range(E))
    assert evicted > 10  # heads were pruned while their rows grew


def test_state_copies_keep_the_buffers():
    st = state([[130, 135]])
    pointers = {name: t.data_ptr() for name, t in st.__dict__.items()}
    other = st.clone()
    assert all(other.__dict__[n].data_ptr() != p for n, p in pointers.items())
    st.lengths.add_(5)
    st.copy_(other)
    assert torch.equal(st.lengths, other.lengths)
    assert {name: t.data_ptr() for name, t in st.__dict__.items()} == pointers


@INTERPRETED
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("path", ["FlattenedDecode", "StepAttention"])
def test_ragged_step_through_sglangs_kernel_in_the_interpreter(sglang_kernel_path, path):
    """The step with attention through SGLang's kernel (Triton's interpreter, float32: ``FlattenedDecode``, or
    ``StepAttention``, the engine's layout with its Triton id copy) and the decision through its Triton kernel gives
    what it gives through the torch paths (the attention formula, the decision's torch formula)."""
    from kvzap_export.bench.ragged_step import StepAttention
    from kvzap_export.kernels import sglang_kernels
    from kvzap_export.bench.flattened_decode import FlattenedDecode

    source = sglang_kernel_path  # the fixture skips, saying so, without SGLang's kernel file
    kernels = sglang_kernels.load(source or None)
    layer = Layer(**SMALL)
    st = state([[129, 170], [133, 140]], spare=6)
    if path == "FlattenedDecode":
        flat = FlattenedDecode(2, 2, 4, 16, st.ids.shape[-1], dtype=torch.float32, device="cpu", max_kv_splits=4,
                               kernels=kernels)
    else:
        flat = StepAttention(2, 2, 4, 16, st.k.shape[0], dtype=torch.float32, device="cpu", kernels=kernels,
                             max_kv_splits=4, use_triton=True)
    twin = st.clone()
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        x = torch.randn(2, 64, generator=g)
        got = ragged_step(layer, st, x, flat, tau=0.0, use_triton=True)
        want = ragged_step(layer, twin, x, decode_attention, tau=0.0, use_triton=False)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(st.lengths, twin.lengths) and torch.equal(st.ids, twin.ids)
        assert torch.equal(st.free, twin.free) and torch.equal(st.top, twin.top) and torch.equal(st.fresh, twin.fresh)
    assert int((st.lengths < torch.tensor([[129, 170], [133, 140]], dtype=torch.int32) + 3).sum()) > 0  # some evicted


@INTERPRETED
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_dense_step_through_sglangs_kernel_equals_sdpa(sglang_kernel_path):
    """``DenseThroughKernel`` (every head one row of all T entries, SGLang's kernel in the interpreter) gives the
    dense step SDPA gives."""
    from kvzap_export.bench.ragged_step import DenseThroughKernel
    from kvzap_export.kernels import sglang_kernels

    layer = Layer(**SMALL)
    g = torch.Generator().manual_seed(2)
    k_cache, v_cache, x = torch.randn(3, 2, 200, 16, generator=g), torch.randn(3, 2, 200, 16, generator=g), torch.randn(3, 64, generator=g)
    dense = DenseThroughKernel(3, 2, 4, 16, 200, dtype=torch.float32, device="cpu", max_kv_splits=4,
                               kernels=sglang_kernels.load(sglang_kernel_path or None), use_triton=True)
    want = dense_step(layer, k_cache.clone(), v_cache.clone(), x)
    got = dense_step(layer, k_cache, v_cache, x, attend=dense)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
