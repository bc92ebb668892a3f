"""The TensorRT-LLM glue's paged-pool arithmetic on the CPU (TensorRT-LLM cannot be installed here): K/V moves
inside ``[pages, 2, heads, tokens_per_block, dim]`` pools, the tail pages, the compaction capacity and the pool checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.integrations.glue_shapes import DIM, KV_HEADS


def test_paged_move_matches_dense_gather():
    from kvzap_export.integrations.trtllm import move_paged_kv

    tpb, pages = 4, torch.tensor([5, 2, 7])
    pool = torch.randn(8, 2, KV_HEADS, tpb, DIM)
    dense = pool[pages].permute(1, 2, 0, 3, 4).reshape(2, KV_HEADS, -1, DIM).clone()  # [2, H, tokens, D]
    indices = torch.tensor([[0, 3, 4, 9, 11], [1, 2, 5, 6, 10]])
    move_paged_kv(pool, pages, indices)
    after = pool[pages].permute(1, 2, 0, 3, 4).reshape(2, KV_HEADS, -1, DIM)
    for h in range(KV_HEADS):
        assert torch.equal(after[:, h, :5], dense[:, h, indices[h]])


def test_trtllm_resize_tail_pages_and_capacity():
    from kvzap_export.errors import ConfigError
    from kvzap_export.integrations.trtllm import cache_pages, check_pool, compaction_capacity, reserved_tail

    manager = SimpleNamespace(num_extra_kv_tokens=2,
                              get_batch_cache_indices=lambda ids, layer: [[4, 9, -1, 6]] if ids == [7] and layer == 5 else None)
    assert reserved_tail(manager) == 2 and reserved_tail(SimpleNamespace()) == 0
    assert cache_pages(manager, 7, 5, tokens=8, tokens_per_block=4).tolist() == [4, 9, -1, 6]  # -1 stays in place
    with pytest.raises(ConfigError, match="sliding-window"):
        cache_pages(manager, 7, 5, tokens=9, tokens_per_block=4)  # block 2 is needed and was dropped
    with pytest.raises(ConfigError, match="sliding-window"):
        cache_pages(manager, 7, 5, tokens=17, tokens_per_block=4)  # more blocks than the cache has
    # The history (the prompt) never shrinks: evicted prompt entries keep their pages; decoding gives them back.
    assert compaction_capacity(count=40, tail=2, history_length=100) == 100
    assert compaction_capacity(count=140, tail=2, history_length=100) == 142
    check_pool(torch.zeros(4, 2, KV_HEADS, 4, DIM, dtype=torch.bfloat16), KV_HEADS, 0)
    with pytest.raises(ConfigError, match="packed"):
        check_pool(torch.zeros(4, 2, KV_HEADS, 4, DIM, dtype=torch.uint8), KV_HEADS, 3)
    with pytest.raises(ConfigError, match="holds 4 heads, KVzap's surrogate slice 2"):
        check_pool(torch.zeros(4, 2, 4, 4, DIM), KV_HEADS, 1)

