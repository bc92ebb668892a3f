"""The TensorRT-LLM glue's scorer on the CPU (TensorRT-LLM cannot be installed here): what it refuses (quantized
or non-float attention input, CUDA-graph forwards, fused RoPE where KVzap evicts)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvzap_export.integrations.scoring import BundleScorer
from tests.integrations.glue_shapes import HIDDEN


def test_trtllm_scorer_refuses_quantized_input_and_fused_rope(surrogate, monkeypatch):
    from kvzap_export.errors import ConfigError
    from kvzap_export.integrations import trtllm

    scorer = trtllm.KVzapScorer(BundleScorer(surrogate))
    with pytest.raises(ConfigError, match="layer 1: the attention input is torch.uint8"):
        scorer.record(1, torch.zeros(4, HIDDEN, dtype=torch.uint8))
    with pytest.raises(ConfigError, match="not float16/bfloat16/float32"):
        scorer.record(0, SimpleNamespace(shape=(4, HIDDEN)))
    with pytest.raises(ConfigError, match="torch.float8_e4m3fn, not float16"):  # is_floating_point() is True for it
        scorer.record(0, torch.zeros(4, HIDDEN, dtype=torch.float8_e4m3fn))
    graph = SimpleNamespace(is_cuda_graph=True, request_ids=[1], seq_lens=torch.tensor([4]), num_contexts=1)
    with pytest.raises(ConfigError, match="cuda_graph_config=None"):
        scorer.record(0, torch.zeros(4, HIDDEN), graph)
    fused = torch.nn.Identity()
    fused.rope_fusion = True
    monkeypatch.setattr(trtllm.process, "STATE", {"evicts": True})
    with pytest.raises(ConfigError, match="layer 0 fuses RoPE"):
        trtllm.attach_scorer([(0, fused)], scorer)
    monkeypatch.setattr(trtllm.process, "STATE", {"evicts": False})  # context-only 1.2.x path: nothing is evicted later
    assert len(trtllm.attach_scorer([(0, fused)], scorer)) == 1


# Stand-in of tensorrt_llm/llmapi/llm_args.py @ af8c3bfa, as far as the compression config goes: a strict
