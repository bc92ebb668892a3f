"""Attention over per-head KV rows: the batched paths (decode: one gather + SDPA; extend: SDPA over the new
tokens, with or without held prefix entries) and the float32 formula against a head-by-head loop written
independently, and the benchmark's Triton decode kernel (``bench/triton_ragged_attention.py``, what
scripts/bench_ragged_decode.py compares with) against the formula (under ``TRITON_INTERPRET=1`` on the CPU; on a GPU
when one is present). Property tests over ragged lengths, GQA groups, empty heads and one-entry heads."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvzap_export.kernels.ragged_attention import (CALL_ENTRIES, MAX_GROUPS, causal_extend_attention, decode_attention,
                                                    layer_groups, prefix_extend_attention, ragged_decode_attention,
                                                    row_groups)


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
    from kvzap_export.bench.triton_ragged_attention import ragged_decode_attention_triton

    q, k_store, v_store, ids, lengths, _rows = build(case)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    scale = 1 / math.sqrt(q.shape[-1])
    kv = torch.cat([k_store, v_store], 1).to(device)  # the ragged mode's combined pool: strided views, read in place
    args = [q.to(device), kv[:, : k_store.shape[1]], kv[:, k_store.shape[1]:], ids.to(device), lengths.to(device)]
    got = ragged_decode_attention_triton(*args, scale).cpu()
    want = ragged_decode_attention(q, k_store, v_store, ids, lengths, scale)
    assert torch.allclose(got, want, atol=2e-6, rtol=2e-6), (got - want).abs().max()
    # and against the batched torch path the CPU engine runs (same ids layout: one call per layer for the batch)
    fast = decode_attention(q, k_store, v_store, ids.clamp(min=0), lengths, scale)
    assert torch.allclose(got, fast, atol=2e-6, rtol=2e-6), (got - fast).abs().max()
    assert torch.equal(got[lengths.repeat_interleave(q.shape[1] // ids.shape[1], dim=1) == 0],
                       torch.zeros_like(got[lengths.repeat_interleave(q.shape[1] // ids.shape[1], dim=1) == 0]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_decode_kernel_in_half_precision(dtype):
    from kvzap_export.bench.triton_ragged_attention import ragged_decode_attention_triton

    q, k_store, v_store, ids, lengths, _ = build((2, 2, 4, 16, 16, 60, [[1, 50], [33, 0]], 7))
    q, k_store, v_store = q.to(dtype), k_store.to(dtype), v_store.to(dtype)
    got = ragged_decode_attention_triton(q, k_store, v_store, ids, lengths, 0.25)
    want = ragged_decode_attention(q, k_store, v_store, ids, lengths, 0.25)  # float32 inside, rounded once
    assert got.dtype == dtype and torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2)


@settings(max_examples=60, deadline=None)
@given(decode_case())
def test_batched_decode_path_equals_head_by_head_attention(case):
    """The path the CPU engine runs: one gather of K and V from the combined pool, one SDPA for the batch."""
    q, k_store, v_store, ids, lengths, rows = build(case)
    scale = 1 / math.sqrt(q.shape[-1])
    padded = ids.clamp(min=0)
    out = decode_attention(q, k_store, v_store, padded, lengths, scale)
    reused = decode_attention(q, k_store, v_store, padded.to(torch.int32), lengths, scale,
                              workspace=torch.full((padded.numel() * q.shape[-1] + 5,), float("nan")))
    assert torch.equal(out, reused)  # int32 ids and a reused (dirty) workspace change nothing
    for b in range(q.shape[0]):
        assert torch.allclose(out[b].double(), loop_reference(q[b], k_store, v_store, rows[b], scale), atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(decode_case(), st.integers(2, 4))
@example(case=(2, 2, 1, 4, 4, 8, [[0, 1], [1, 1]], 0), most=2)  # unequal rows, yet no split pads fewer (found by CI)
def test_decode_rows_grouped_by_length_equal_head_by_head_attention(case, most):
    """The torch path with its rows split into groups padded each to its own width (``row_groups``, forced to split:
    no cost per call), each group through a workspace another group used before."""
    q, k_store, v_store, ids, lengths, rows = build(case)
    scale = 1 / math.sqrt(q.shape[-1])
    split = row_groups(lengths.reshape(-1).tolist(), most=most, call_cost=0)
    if split is None:  # with no cost per call: no cut of the sorted rows into 2..most equal counts pads fewer entries
        ranked = sorted(lengths.reshape(-1).tolist())
        n = len(ranked)
        for k in range(2, min(most, n) + 1):
            parts = [ranked[n * i // k: n * (i + 1) // k] for i in range(k)]
            assert sum(len(part) * part[-1] for part in parts) >= n * ranked[-1], (ranked, k)
        return
    assert sorted(r for group, _ in split for r in group) == list(range(lengths.numel()))  # each row once
    assert all(width == max(lengths.reshape(-1)[group].tolist()) for group, width in split)
    groups = [(torch.tensor(group), width) for group, width in split]
    out = decode_attention(q, k_store, v_store, ids.clamp(min=0), lengths, scale, groups=groups,
                           workspace=torch.full((ids.numel() * q.shape[-1],), float("nan")))
    for b in range(q.shape[0]):
        assert torch.allclose(out[b].double(), loop_reference(q[b], k_store, v_store, rows[b], scale), atol=1e-5)


def test_row_groups_split_only_where_padding_costs_more_than_a_call():
    assert row_groups([4000] * 45) is None  # KVzap off: every row as long
    assert row_groups([10, 20, 30, 40]) is None  # short rows: one call is cheaper than the padding it saves
    skewed = [150, 4000, 600, 3900, 500, 4096] * 5  # a layer's heads as KVzap leaves them at 4k tokens
    split = row_groups(skewed)
    assert split is not None and 2 <= len(split) <= MAX_GROUPS
    padded = sum(len(group) * width for group, width in split) + len(split) * CALL_ENTRIES
    assert padded < len(skewed) * max(skewed) + CALL_ENTRIES
    assert [width for _, width in split] == sorted(width for _, width in split)
    assert layer_groups([[4000] * 6, skewed])[0] is None and len(layer_groups([skewed])[0]) == len(split)


def causal_loop(q, k, v, lens, prefixes, scale):
    """Token by token, head by head, float64: each query sees its head's prefix entries and its own chunk up to
    itself. prefixes: per request, per KV head, (keys [p, D], values [p, Dv])."""
    out, start = [], 0
    for b, n in enumerate(lens):
        for t in range(n):
            row = torch.zeros(q.shape[1], v.shape[2], dtype=torch.float64)
            group = q.shape[1] // k.shape[1]
            for head in range(q.shape[1]):
                h = head // group
                pk, pv = prefixes[b][h] if prefixes else (k[:0, h], v[:0, h])
                keys = torch.cat([pk, k[start: start + t + 1, h]]).double()
                values = torch.cat([pv, v[start: start + t + 1, h]]).double()
                row[head] = torch.softmax(keys @ q[start + t, head].double() * scale, 0) @ values
            out.append(row)
        start += n
    return torch.stack(out)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=4), st.integers(1, 3), st.sampled_from([1, 3]),
       st.integers(0, 2**16))
def test_fresh_prompts_attend_causally_over_their_own_tokens(lens, kv_heads, group, seed):
    g = torch.Generator().manual_seed(seed)
    T, dim = sum(lens), 8
    q = torch.randn(T, kv_heads * group, dim, generator=g)
    k, v = torch.randn(T, kv_heads, dim, generator=g), torch.randn(T, kv_heads, dim, generator=g)
    out = causal_extend_attention(q, k, v, lens, 0.3)
    assert torch.allclose(out.double(), causal_loop(q, k, v, lens, None, 0.3), atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=3), st.integers(1, 3), st.sampled_from([1, 3]),
       st.booleans(), st.integers(0, 2**16), st.sampled_from([None, 1, 700]))
def test_chunks_attend_over_each_heads_held_prefix_then_causally(lens, kv_heads, group, agree, seed, block_bytes):
    """A prompt chunk after entries each head holds (all heads the same count when ``agree``, as before any
    decision; different subsets otherwise), in one call or in blocks of queries (``block_bytes``: one query a block,
    a few, all)."""
    g = torch.Generator().manual_seed(seed)
    T, dim, store = sum(lens), 8, 64
    q = torch.randn(T, kv_heads * group, dim, generator=g)
    k, v = torch.randn(T, kv_heads, dim, generator=g), torch.randn(T, kv_heads, dim, generator=g)
    kv = torch.randn(store, 2 * dim, generator=g)
    held = [[int(torch.randint(0, 12, (), generator=g)) for _ in range(kv_heads)] for _ in lens]
    if agree:
        held = [[row[0]] * kv_heads for row in held]
    width = max(1, max(max(row) for row in held))
    ids = torch.zeros(len(lens), kv_heads, width, dtype=torch.int64)
    prefixes = []
    for b, row in enumerate(held):
        prefixes.append([])
        for h, n in enumerate(row):
            ids[b, h, :n] = torch.randperm(store, generator=g)[:n]
            prefixes[b].append((kv[ids[b, h, :n], :dim], kv[ids[b, h, :n], dim:]))
    blocks = {} if block_bytes is None else {"block_bytes": block_bytes}
    out = prefix_extend_attention(q, k, v, lens, kv[ids, :dim], kv[ids, dim:], torch.tensor(held), 0.3,
                                  heads_agree=agree, **blocks)
    assert torch.allclose(out.double(), causal_loop(q, k, v, lens, prefixes, 0.3), atol=1e-5)


def test_query_blocks_keep_a_32k_chunks_scores_bounded():
    """Llama-3.1-8B's second 8,192-token chunk of a 32k prompt: one call's float32 scores would take 8 GiB per
    request; the blocks' stay under BLOCK_SCORE_BYTES."""
    from kvzap_export.kernels.ragged_attention import BLOCK_SCORE_BYTES, query_block

    block = query_block(1, 32, 8192 + 8192, 8192)
    assert 4 * 32 * block * 16384 <= BLOCK_SCORE_BYTES < 4 * 32 * (block + 1) * 16384
    assert query_block(2, 9, 100, 50) == 50 and query_block(64, 64, 1 << 20, 10) == 1
