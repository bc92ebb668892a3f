"""Per-layer, per-head KV masking for evaluation: an attention function that adds a layer's own bias.

A single 4D attention mask is shared by all layers; KVzap's decisions differ per layer and head, so the
bias is looked up by ``module.layer_idx`` inside a registered attention function wrapping eager attention.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

NAME = "kvzap_eval_masked"
_BIAS: dict[int, torch.Tensor] = {}


def _attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.models.llama.modeling_llama import eager_attention_forward

    bias = _BIAS.get(module.layer_idx)
    if bias is not None:
        bias = bias[..., : key.shape[-2]].to(query.dtype)
        attention_mask = bias if attention_mask is None else attention_mask + bias[..., -attention_mask.shape[-2]:, :]
    return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)


@contextlib.contextmanager
def layer_masks(llm, biases: dict[int, torch.Tensor]) -> Iterator[None]:
    """biases: layer -> additive mask (1, num_heads, q_len, kv_len) with 0 / -inf."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, eager_mask)  # float 0/-inf masks, as eager attention expects
    previous = llm.config._attn_implementation
    _BIAS.clear()
    _BIAS.update(biases)
    llm.set_attn_implementation(NAME)
    try:
        yield
    finally:
        _BIAS.clear()
        llm.set_attn_implementation(previous)


def prune_bias(pruned: torch.Tensor, prompt_len: int, total_len: int, num_heads: int) -> torch.Tensor:
    """pruned: bool (kv_heads, prompt_len) -> bias (1, num_heads, total, total): causal everywhere, and
    continuation queries (prefill is dense, as kvpress) do not see pruned prompt keys of their KV head."""
    kv_heads = pruned.shape[0]
    bias = torch.full((total_len, total_len), float("-inf")).triu(1)[None, None].repeat(1, num_heads, 1, 1)
    per_head = pruned.repeat_interleave(num_heads // kv_heads, dim=0)  # (H, prompt_len)
    block = bias[0, :, prompt_len:, :prompt_len]
    block[per_head[:, None, :].expand_as(block)] = float("-inf")
    return bias
