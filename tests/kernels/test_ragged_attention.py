"""Attention over per-head KV rows: the torch path against a head-by-head loop written independently, and the
Triton decode kernel against the torch path (under ``TRITON_INTERPRET=1`` on the CPU; on a GPU when one is
present). Property tests over ragged lengths, GQA groups, empty heads and one-entry heads."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvzap_export.kernels.ragged_attention import ragged_decode_attention, ragged_extend_attention


def loop_reference(q, k_store, v_store, rows, scale):
    """q: [Hq, D]; rows: per KV head, a list of entry ids. Head by head, in float64."""
    group = q.shape[0] // len(rows)
    out = torch.zeros(q.shape[0], v_store.shape[1], dtype=torch.float64)
    for head in range(q.shape[0]):
        ids = rows[head // group]
        if not ids:
            continue
        keys, values = k_store[ids].double(), v_store[ids].double()
        weights = torch.softmax(keys @ q[head].double() * scale, dim=0)
        out[head] = weights @ values
    return out


@st.composite
def decode_case(draw):
    batch = draw(st.integers(1, 3))
    kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4]))
    dim = draw(st.sampled_from([4, 8, 16]))
    v_dim = draw(st.sampled_from([dim, 8]))
    store = draw(st.integers(8, 80))
    lengths = [[draw(st.integers(0, min(store, 70))) for _ in range(kv_heads)] for _ in range(batch)]
    seed = draw(st.integers(0, 2**16))
    return batch, kv_heads, group, dim, v_dim, store, lengths, seed


def build(case):
    batch, kv_heads, group, dim, v_dim, store, lengths, seed = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, kv_heads * group, dim, generator=g)
    k_store, v_store = torch.randn(store, dim, generator=g), torch.randn(store, v_dim, generator=g)
    width = max(1, max(max(row) for row in lengths))
    ids = torch.full((batch, kv_heads, width), -1, dtype=torch.int64)
    rows = []
    for b in range(batch):
        rows.append([])
        for h in range(kv_heads):
            chosen = torch.randperm(store, generator=g)[: lengths[b][h]]
            ids[b, h, : lengths[b][h]] = chosen
            rows[b].append(chosen.tolist())
    return q, k_store, v_store, ids, torch.tensor(lengths), rows


@settings(max_examples=60, deadline=None)
@given(decode_case())
def test_decode_torch_path_equals_head_by_head_attention(case):
    q, k_store, v_store, ids, lengths, rows = build(case)
    scale = 1 / math.sqrt(q.shape[-1])
    out = ragged_decode_attention(q, k_store, v_store, ids, lengths, scale)
    for b in range(q.shape[0]):
        assert torch.allclose(out[b].double(), loop_reference(q[b], k_store, v_store, rows[b], scale), atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(decode_case())
def test_triton_decode_kernel_equals_the_torch_path(case):
    from kvzap_export.kernels.triton_ragged_attention import ragged_decode_attention_triton

    q, k_store, v_store, ids, lengths, _rows = build(case)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    scale = 1 / math.sqrt(q.shape[-1])
    args = [t.to(device) for t in (q, k_store, v_store, ids, lengths)]
    got = ragged_decode_attention_triton(*args, scale).cpu()
    want = ragged_decode_attention(q, k_store, v_store, ids, lengths, scale)
    assert torch.allclose(got, want, atol=2e-6, rtol=2e-6), (got - want).abs().max()
    assert torch.equal(got[lengths.repeat_interleave(q.shape[1] // ids.shape[1], dim=1) == 0],
                       torch.zeros_like(got[lengths.repeat_interleave(q.shape[1] // ids.shape[1], dim=1) == 0]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_decode_kernel_in_half_precision(dtype):
    from kvzap_export.kernels.triton_ragged_attention import ragged_decode_attention_triton

    q, k_store, v_store, ids, lengths, _ = build((2, 2, 4, 16, 16, 60, [[1, 50], [33, 0]], 7))
    q, k_store, v_store = q.to(dtype), k_store.to(dtype), v_store.to(dtype)
    got = ragged_decode_attention_triton(q, k_store, v_store, ids, lengths, 0.25)
    want = ragged_decode_attention(q, k_store, v_store, ids, lengths, 0.25)  # float32 inside, rounded once
    assert got.dtype == dtype and torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.sampled_from([1, 3]), st.integers(1, 12), st.integers(0, 2**16))
def test_extend_is_causal_by_logical_positions(kv_heads, group, tokens, seed):
    """A prompt chunk at logical positions p0..p0+T-1 over heads that hold different subsets of the prefix."""
    g = torch.Generator().manual_seed(seed)
    dim, store = 8, 64
    prefix = int(torch.randint(0, 20, (), generator=g))
    q = torch.randn(tokens, kv_heads * group, dim, generator=g)
    k_store, v_store = torch.randn(store, dim, generator=g), torch.randn(store, dim, generator=g)
    total = prefix + tokens
    ids = torch.full((kv_heads, total), -1, dtype=torch.int64)
    positions = torch.full((kv_heads, total), -1, dtype=torch.int64)
    lengths, kept = [], []
    for h in range(kv_heads):
        keep_prefix = sorted(torch.randperm(prefix, generator=g)[: int(torch.randint(0, prefix + 1, (), generator=g))].tolist())
        held = keep_prefix + list(range(prefix, total))  # the new tokens are in every head
        entries = torch.randperm(store, generator=g)[: len(held)]
        ids[h, : len(held)], positions[h, : len(held)] = entries, torch.tensor(held)
        lengths.append(len(held))
        kept.append(list(zip(held, entries.tolist())))
    q_positions = torch.arange(prefix, total)
    out = ragged_extend_attention(q, k_store, v_store, ids, positions, torch.tensor(lengths), q_positions, 0.3)
    for t in range(tokens):
        rows = [[e for p, e in kept[h] if p <= prefix + t] for h in range(kv_heads)]
        assert torch.allclose(out[t].double(), loop_reference(q[t], k_store, v_store, rows, 0.3), atol=1e-5)
