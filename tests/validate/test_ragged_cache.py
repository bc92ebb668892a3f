"""The per-head ragged cache layer: holds exactly the kept entries, appends per head, masks padding."""

import pytest
import torch

from kvzap_export.ops import kv_compaction, threshold_compaction
from kvzap_export.validate.ragged_cache import RaggedHeadsLayer


def _compacted(seed=0, batch=1, heads=3, seq=40, dim=8):
    gen = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(batch, heads, seq, dim, generator=gen), torch.randn(batch, heads, seq, dim, generator=gen)
    result = threshold_compaction(torch.randn(batch, heads, seq, generator=gen), torch.full((batch,), seq), 0.3, 4)
    moved_k, moved_v = kv_compaction(keys, values, result.indices)
    return keys, values, result, moved_k, moved_v


def test_holds_each_heads_kept_entries_and_nothing_else():
    keys, values, result, moved_k, moved_v = _compacted(batch=2)
    layer = RaggedHeadsLayer.from_compacted(moved_k, moved_v, result.counts)
    counts = result.counts.tolist()
    assert layer.lengths() == counts and len({c for row in counts for c in row}) > 1 and counts[0] != counts[1]
    for b, row in enumerate(counts):
        assert layer.held_bytes(b) == 2 * sum(row) * 8 * 4
        for h, count in enumerate(row):
            kept = result.indices[b, h, :count].long()
            assert torch.equal(layer.head_keys[b][h], keys[b, h, kept])
            assert torch.equal(layer.head_values[b][h], values[b, h, kept])
    assert layer.held_bytes() == layer.held_bytes(0) + layer.held_bytes(1)


def test_update_appends_per_head_and_returns_a_masked_padded_view():
    _, _, result, moved_k, moved_v = _compacted(seed=1, batch=2)
    layer = RaggedHeadsLayer.from_compacted(moved_k, moved_v, result.counts)
    before = layer.lengths()
    new_k, new_v = torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8)
    k, v = layer.update(new_k, new_v)
    widest = max(max(row) for row in before)
    assert layer.lengths() == [[n + 1 for n in row] for row in before] and layer.get_seq_length() == widest + 1
    assert k.shape == (2, 3, widest + 1, 8) and k.is_contiguous()
    for b, row in enumerate(before):
        for h, n in enumerate(row):
            assert torch.equal(k[b, h, n], new_k[b, h, 0]) and torch.equal(v[b, h, n], new_v[b, h, 0])
            assert layer.valid[b, h, : n + 1].all() and not layer.valid[b, h, n + 1 :].any()
            assert torch.isfinite(k[b, h]).all()  # padding is finite: masked weights stay exactly zero


def test_attention_over_the_padded_view_equals_attention_over_kept_entries():
    _, _, result, moved_k, moved_v = _compacted(seed=2, batch=2)
    layer = RaggedHeadsLayer.from_compacted(moved_k, moved_v, result.counts)
    k, v = layer.update(torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8))
    q = torch.randn(2, 3, 1, 8)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=layer.valid[:, :, None, :])
    for b in range(2):
        for h in range(3):
            ref = torch.nn.functional.scaled_dot_product_attention(q[b : b + 1, h : h + 1], layer.head_keys[b][h][None, None],
                                                                   layer.head_values[b][h][None, None])
            torch.testing.assert_close(out[b : b + 1, h : h + 1], ref, rtol=1e-5, atol=1e-6)


def test_counts_must_cover_every_sequence():
    _, _, result, moved_k, moved_v = _compacted(batch=2)
    with pytest.raises(ValueError, match="counts for 1 sequences, K/V for 2"):
        RaggedHeadsLayer.from_compacted(moved_k, moved_v, result.counts[:1])
