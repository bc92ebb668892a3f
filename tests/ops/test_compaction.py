"""The reference op: semantics, invariants, engine formats and bad input."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvzap_export.errors import InputError
from kvzap_export.ops import (kv_compaction, memory_report, recompact, threshold_compaction, trtllm_sparse_layout,
                              uniform_selection)

SPECIAL = [float("nan"), float("inf"), float("-inf")]


@st.composite
def cases(draw, max_batch=3, max_heads=4, max_seq=64):
    batch = draw(st.integers(1, max_batch))
    heads = draw(st.integers(1, max_heads))
    seq = draw(st.integers(1, max_seq))
    threshold = draw(st.sampled_from([-1.0, 0.0, 0.5, -7.25]) | st.floats(-3, 3, allow_nan=False, width=32))
    window = draw(st.integers(0, seq + 2))
    sink = draw(st.sampled_from([0, 0, 1, 4]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, heads, seq, generator=gen) + threshold
    # Ties with τ and special values.
    mask = torch.rand(batch, heads, seq, generator=gen)
    scores = torch.where(mask < 0.1, torch.tensor(threshold), scores)
    for i, value in enumerate(SPECIAL):
        scores = torch.where((mask >= 0.1 + 0.03 * i) & (mask < 0.13 + 0.03 * i), torch.tensor(value), scores)
    lengths = torch.randint(0, seq + 1, (batch,), generator=gen, dtype=torch.int32)
    return scores.to(dtype), lengths, threshold, window, sink


def brute_force(scores, lengths, threshold, window, sink):
    b_, h_, t_ = scores.shape
    keep = torch.zeros(b_, h_, t_, dtype=torch.bool)
    for b in range(b_):
        n = int(lengths[b])
        for h in range(h_):
            for t in range(n):
                s = scores[b, h, t]
                below = bool(s < threshold)  # tensor < Python float: compared in the scores' dtype
                keep[b, h, t] = t >= n - window or t < sink or not below
    return keep


@settings(max_examples=60, deadline=None)
@given(cases())
def test_matches_brute_force_and_invariants(case):
    scores, lengths, threshold, window, sink = case
    keep, counts, indices = threshold_compaction(scores, lengths, threshold, window, sink)
    assert torch.equal(keep, brute_force(scores, lengths, threshold, window, sink))
    assert counts.dtype == torch.int32 and indices.dtype == torch.int32
    assert torch.equal(counts, keep.sum(-1).to(torch.int32))
    seq = scores.shape[-1]
    pos = torch.arange(seq)
    for b in range(scores.shape[0]):
        n = int(lengths[b])
        assert not keep[b, :, n:].any()  # padding never kept
        assert keep[b, :, max(0, n - window):n].all()  # window always kept
        assert keep[b, :, : min(sink, n)].all()
        assert keep[b, :, :n][torch.isnan(scores[b, :, :n].float())].all()  # NaN is kept (strict <)
        for h in range(scores.shape[1]):
            c = int(counts[b, h])
            row = indices[b, h]
            assert torch.equal(row[:c], pos[keep[b, h]].to(torch.int32))  # ascending kept positions
            assert (row[c:] == -1).all()


@settings(max_examples=40, deadline=None)
@given(cases())
def test_uniform_contains_every_ragged_index(case):
    scores, lengths, threshold, window, sink = case
    result = threshold_compaction(scores, lengths, threshold, window, sink)
    selection = uniform_selection(scores, result.keep, lengths)
    assert torch.equal(selection.counts, result.counts.amax(dim=1).to(torch.int32))
    for b in range(scores.shape[0]):
        k = int(selection.counts[b])
        for h in range(scores.shape[1]):
            chosen = selection.indices[b, h, :k]
            assert (chosen >= 0).all() and (chosen < max(int(lengths[b]), 1)).all()
            assert torch.equal(chosen, torch.sort(chosen).values) and len(set(chosen.tolist())) == k
            assert set(result.indices[b, h, : int(result.counts[b, h])].tolist()) <= set(chosen.tolist())
            assert (selection.indices[b, h, k:] == -1).all()


def test_uniform_adds_best_scored_evicted_tokens():
    scores = torch.tensor([[[5.0, -1.0, -3.0, -2.0, 9.0], [5.0, 4.0, 3.0, -9.0, 9.0]]])
    lengths = torch.tensor([5])
    result = threshold_compaction(scores, lengths, 0.0, 1)
    assert result.counts.tolist() == [[2, 4]]
    selection = uniform_selection(scores, result.keep, lengths)
    assert selection.indices[0, 0].tolist() == [0, 1, 3, 4]  # -1 and -2 are head 0's best evicted
    assert selection.indices[0, 1].tolist() == [0, 1, 2, 4]


def test_uniform_across_layers_shares_one_count():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 2, 4, 40, generator=gen)
    lengths = torch.tensor([40, 25])
    keep = torch.stack([threshold_compaction(s, lengths, 0.5, 4).keep for s in scores])
    selection = uniform_selection(scores, keep, lengths)
    assert selection.indices.shape[:3] == (3, 2, 4)
    assert torch.equal(selection.counts, keep.sum(-1).amax(dim=(0, 2)).to(torch.int32))
    pos = torch.arange(40)
    for layer in range(3):
        for b in range(2):
            k = int(selection.counts[b])
            for h in range(4):
                chosen = selection.indices[layer, b, h]
                assert set(pos[keep[layer, b, h]].tolist()) <= set(chosen[:k].tolist())
                assert (chosen[k:] == -1).all() and (chosen[:k] < int(lengths[b])).all()
    report = memory_report(keep.sum(-1), lengths)
    assert report["uniform_entries"] == float(selection.counts.sum()) * 4 * 3  # heads x layers
    assert report["ragged_freed"] >= report["per_layer_padded_freed"] >= report["uniform_freed"] >= 0


def test_trtllm_layout():
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 4, 30, generator=gen)
    lengths = torch.tensor([30, 12, 20])
    result = threshold_compaction(scores, lengths, 0.3, 5)
    selection = uniform_selection(scores, result.keep, lengths)
    flat, offsets = trtllm_sparse_layout(selection)
    assert flat.dtype == torch.int32 and offsets.dtype == torch.int32
    assert flat.shape == (4, int(selection.counts.sum())) and offsets.tolist()[0] == 0
    for b in range(3):
        part = flat[:, offsets[b]: offsets[b + 1]]
        assert torch.equal(part, selection.indices[b, :, : int(selection.counts[b])])
        assert (part[:, 1:] > part[:, :-1]).all()  # sorted per head


def test_memory_report_orders_layouts():
    counts = torch.tensor([[[3, 10], [5, 5]], [[8, 2], [1, 6]]])  # [layers, batch, heads]
    report = memory_report(counts, torch.tensor([12, 12]))
    assert report["full_entries"] == 12 * 2 * 2 * 2
    assert report["ragged_entries"] == 40
    assert report["per_layer_padded_entries"] == (10 + 5 + 8 + 6) * 2
    assert report["uniform_entries"] == (10 + 6) * 2 * 2
    assert report["ragged_freed"] >= report["per_layer_padded_freed"] >= report["uniform_freed"]


def test_recompact_equals_decoding_semantics():
    """Decode: test each token once when it leaves the window == re-apply to the compacted cache."""
    gen = torch.Generator().manual_seed(3)
    window, tau = 4, 0.0
    all_scores = torch.randn(1, 2, 30, generator=gen)
    masked = torch.zeros(1, 2, 30, dtype=torch.bool)
    for t in range(30):  # kvpress-style: token t - window leaves the window at step t
        out = t - window
        if out >= 0:
            masked[..., out] = all_scores[..., out] < tau
    # Ours: keep the compacted cache and its stored scores, re-apply after every step.
    stored = [[] for _ in range(2)]
    for t in range(30):
        for h in range(2):
            stored[h].append((t, float(all_scores[0, h, t])))
        for h in range(2):
            s = torch.tensor([[[v for _, v in stored[h]]]])
            keep = recompact(s, torch.tensor([s.shape[-1]]), tau, window).keep[0, 0]
            stored[h] = [entry for entry, k in zip(stored[h], keep.tolist()) if k]
    for h in range(2):
        kept_positions = {p for p, _ in stored[h]}
        assert kept_positions == {t for t in range(30) if not masked[0, h, t]}


def test_kv_compaction_moves_kept_entries_first():
    keys = torch.arange(2 * 2 * 6 * 3, dtype=torch.float32).reshape(2, 2, 6, 3)
    values = -keys
    indices = torch.tensor([[[0, 2, 5, -1, -1, -1], [1, -1, -1, -1, -1, -1]], [[0, 1, 2, 3, 4, 5], [-1] * 6]], dtype=torch.int32)
    k, v = kv_compaction(keys, values, indices)
    assert torch.equal(k[0, 0, :3], keys[0, 0, [0, 2, 5]]) and (k[0, 0, 3:] == 0).all()
    assert torch.equal(v[0, 1, :1], values[0, 1, [1]]) and (v[0, 1, 1:] == 0).all()
    assert torch.equal(k[1, 0], keys[1, 0]) and (k[1, 1] == 0).all()


@pytest.mark.parametrize("call, message", [
    (lambda: threshold_compaction(torch.zeros(2, 3), torch.tensor([1, 1]), 0.0, 1), "scores must be a tensor"),
    (lambda: threshold_compaction(torch.zeros(2, 3, 4, dtype=torch.int32), torch.tensor([1, 1]), 0.0, 1), "float16/bfloat16/float32"),
    (lambda: threshold_compaction(torch.zeros(2, 3, 4), torch.tensor([1, 1, 1]), 0.0, 1), "batch 3 but scores has batch 2"),
    (lambda: threshold_compaction(torch.zeros(2, 3, 4), torch.tensor([[1, 1]]), 0.0, 1), "lengths must be a 1-D"),
    (lambda: threshold_compaction(torch.zeros(2, 3, 4), torch.tensor([1.0, 1.0]), 0.0, 1), "integer tensor"),
    (lambda: threshold_compaction(torch.zeros(2, 3, 4), torch.tensor([1, 5]), 0.0, 1), "lengths must lie in"),
    (lambda: threshold_compaction(torch.zeros(2, 3, 4), torch.tensor([-1, 2]), 0.0, 1), "lengths must lie in"),
    (lambda: threshold_compaction(torch.zeros(2, 3, 4), torch.tensor([1, 2]), 0.0, -1), "window must be in"),
    (lambda: threshold_compaction(torch.zeros(2, 3, 4), torch.tensor([1, 2]), 0.0, 2**30), "window must be in"),
    (lambda: threshold_compaction(torch.zeros(2, 3, 4), torch.tensor([1, 2]), math.nan, 1), "threshold is NaN"),
    (lambda: threshold_compaction(torch.zeros(2, 3, 4), torch.tensor([1, 2]), "low", 1), "threshold must be a number"),
    (lambda: threshold_compaction(torch.zeros(2, 3, 4), torch.tensor([1, 2]), 0.0, 1.5), "window must be an integer"),
    (lambda: kv_compaction(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 5), torch.zeros(1, 2, 3, dtype=torch.int32)), "keys and values"),
    (lambda: kv_compaction(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 4, dtype=torch.int32)), "indices must be"),
])
def test_bad_input_is_a_clear_error(call, message):
    with pytest.raises(InputError, match=message):
        call()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=0, max_size=4), st.sampled_from([torch.float32, torch.int64, torch.bool, torch.float64]),
       st.integers(-3, 3), st.one_of(st.floats(), st.integers(), st.text(max_size=2)), st.one_of(st.integers(-5, 10), st.floats()))
def test_fuzzed_public_api_raises_only_typed_errors(shape, dtype, batch, threshold, window):
    scores = torch.zeros(shape, dtype=dtype)
    lengths = torch.zeros(max(batch, 0), dtype=torch.int32)
    try:
        result = threshold_compaction(scores, lengths, threshold, window)
    except InputError:
        return
    assert result.keep.shape == scores.shape
