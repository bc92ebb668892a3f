"""The TensorRT-LLM glue's context-phase sparse layout and prompt lengths on the CPU (TensorRT-LLM cannot be
installed here)."""

from __future__ import annotations

import torch

from kvzap_export.integrations.core import KVzapPolicy
from kvzap_export.integrations.scoring import BundleScorer
from tests.integrations.glue_shapes import HIDDEN, KV_HEADS, WINDOW


def test_context_sparse_kv_layout(surrogate):
    from kvzap_export.integrations.core import context_budget
    from kvzap_export.integrations.trtllm import context_sparse_kv

    scorer = BundleScorer(surrogate)
    hidden = torch.randn(50 + 9, HIDDEN, generator=torch.Generator().manual_seed(5))
    layer_scores = scorer.score(0, hidden)
    policy = KVzapPolicy(0.0, window=WINDOW)
    indices, offsets = context_sparse_kv(layer_scores, [50, 9], policy, keep_fraction=0.4)
    budgets = [context_budget(50, 0.4, WINDOW), context_budget(9, 0.4, WINDOW)]
    assert budgets == [20, 6]
    assert indices.shape == (KV_HEADS, sum(budgets)) and indices.dtype == torch.int32 and offsets.dtype == torch.int32
    assert offsets.tolist() == [0, 20, 26]
    assert bool((indices[:, 20:] < 9).all()) and bool((indices[:, 14:20] == torch.arange(44, 50, dtype=torch.int32)).all())


def test_trtllm_prompt_lens_clamped_for_generation_requests_only():
    from kvzap_export.integrations.trtllm import clamp_prompt_lens

    assert clamp_prompt_lens([100, 40, 100, 10], 2, lambda p: p // 2) == [100, 40, 50, 5]

