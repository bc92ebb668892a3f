"""The per-head ragged cache layer: holds exactly the kept entries, appends per head, masks padding."""

import torch

from kvzap_export.ops import kv_compaction, threshold_compaction
from kvzap_export.validate.ragged_cache import RaggedHeadsLayer


def _compacted(seed=0, heads=3, seq=40, dim=8):
    gen = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(1, heads, seq, dim, generator=gen), torch.randn(1, heads, seq, dim, generator=gen)
    result = threshold_compaction(torch.randn(1, heads, seq, generator=gen), torch.tensor([seq]), 0.3, 4)
    moved_k, moved_v = kv_compaction(keys, values, result.indices)
    return keys, values, result, moved_k, moved_v


def test_holds_each_heads_kept_entries_and_nothing_else():
    keys, values, result, moved_k, moved_v = _compacted()
    layer = RaggedHeadsLayer.from_compacted(moved_k, moved_v, result.counts[0])
    counts = result.counts[0].tolist()
    assert layer.lengths() == counts and len(set(counts)) > 1
    assert layer.held_bytes() == 2 * sum(counts) * 8 * 4
    for h, count in enumerate(counts):
        kept = result.indices[0, h, :count].long()
        assert torch.equal(layer.head_keys[h], keys[0, h, kept])
        assert torch.equal(layer.head_values[h], values[0, h, kept])


def test_update_appends_per_head_and_returns_a_masked_padded_view():
    _, _, result, moved_k, moved_v = _compacted(seed=1)
    layer = RaggedHeadsLayer.from_compacted(moved_k, moved_v, result.counts[0])
    before = layer.lengths()
    new_k, new_v = torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)
    k, v = layer.update(new_k, new_v)
    assert layer.lengths() == [n + 1 for n in before] and layer.get_seq_length() == max(before) + 1
    assert k.shape == (1, 3, max(before) + 1, 8) and k.is_contiguous()
    for h, n in enumerate(before):
        assert torch.equal(k[0, h, n], new_k[0, h, 0]) and torch.equal(v[0, h, n], new_v[0, h, 0])
        assert layer.valid[h, : n + 1].all() and not layer.valid[h, n + 1 :].any()
        assert torch.isfinite(k[0, h]).all()  # padding is finite: masked weights stay exactly zero


def test_attention_over_the_padded_view_equals_attention_over_kept_entries():
    _, _, result, moved_k, moved_v = _compacted(seed=2)
    layer = RaggedHeadsLayer.from_compacted(moved_k, moved_v, result.counts[0])
    k, v = layer.update(torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8))
    q = torch.randn(1, 3, 1, 8)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=layer.valid[None, :, None, :])
    for h in range(3):
        ref = torch.nn.functional.scaled_dot_product_attention(q[:, h : h + 1], layer.head_keys[h][None, None],
                                                               layer.head_values[h][None, None])
        torch.testing.assert_close(out[:, h : h + 1], ref, rtol=1e-5, atol=1e-6)
