"""TensorRT-LLM 1.2.x (sparse attention framework): KVzap's context-phase selection as ``sparse_kv_predict``,
a fixed budget per request from its prompt length. The selection is engine-free; the attention class derives
from TensorRT-LLM's ``TrtllmAttention``."""

from __future__ import annotations

import torch

from kvzap_export.errors import ConfigError
from kvzap_export.integrations.core import KVzapPolicy, budget_selection, context_budget, sparse_layout
from kvzap_export.integrations.trtllm import process
from kvzap_export.integrations.trtllm.scoring import KVzapScorer


def check_whole_prompts(seq_lens, prompt_lens, cached) -> None:
    """1.2.x: the budget comes from the prompt length, so each context request must feed its whole prompt in
    one forward, with nothing cached before it (no chunked context, no block reuse)."""
    for i, (fed, prompt, done) in enumerate(zip(seq_lens, prompt_lens, cached)):
        if int(fed) != int(prompt) or int(done) != 0:
            raise ConfigError(f"context request {i} feeds {int(fed)} of its {int(prompt)} prompt tokens with {int(done)} "
                              "cached; KVzap's 1.2.x variant needs whole prompts: turn off chunked context "
                              "(enable_chunked_prefill=False) and block reuse (KvCacheConfig(enable_block_reuse=False))")


def no_reuse_manager_class(base: type) -> type:
    """``base`` (the stock ``KVCacheManager``) refusing block reuse at construction, as RocketKV's manager does:
    compacted blocks no longer hold the tokens they would be reused for."""

    class KVzapKVCacheManager(base):
        def __init__(self, kv_cache_config, *args, **kwargs):
            if getattr(kv_cache_config, "enable_block_reuse", False):
                raise ConfigError("KVzap's 1.2.x variant needs block reuse off: KvCacheConfig(enable_block_reuse=False)")
            super().__init__(kv_cache_config, *args, **kwargs)

    return KVzapKVCacheManager


def clamp_prompt_lens(prompt_lens: list[int], num_contexts: int, budget_of) -> list[int]:
    """Generation requests' prompt lengths as the attention kernel must see them after context compaction:
    ``min(prompt, budget_of(prompt))``; context requests unchanged."""
    return [p if i < num_contexts else min(p, budget_of(p)) for i, p in enumerate(int(x) for x in prompt_lens)]



def context_sparse_kv(layer_scores: torch.Tensor, seq_lens: list[int], policy: KVzapPolicy,
                      keep_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``sparse_kv_predict``'s output for one layer from the context requests' scores.

    layer_scores: [num_context_tokens, kv_heads] (packed, request after request); seq_lens: tokens per
    context request (whole prompts). Each request keeps ``context_budget(T)`` tokens per head
    (``budget_selection``). Returns (int32 [kv_heads, total_selected], int32 [num_contexts + 1]).
    """
    rows, start = [], 0
    for n in seq_lens:
        scores = layer_scores[start: start + n].T[None]  # [1, H, n]
        start += n
        budget = context_budget(n, keep_fraction, policy.window, policy.sink)
        sel = budget_selection(scores, torch.tensor([n]), torch.tensor([budget]), policy)
        rows.append(sel.indices[0])
    indices, offsets = sparse_layout(rows)
    return indices.to(layer_scores.device), offsets.to(layer_scores.device)



def sparse_attention_class(keep_fraction: float, policy: KVzapPolicy) -> type:
    """1.2.x: ``TrtllmAttention`` whose ``sparse_kv_predict`` returns KVzap's context selection.

    Limits: context phase only (no eviction during generation); whole prompts (chunked prefill off,
    block reuse off); a fixed budget per request, ``context_budget(T, keep_fraction)``, because the
    kept count must be known from the prompt length alone when the metadata shortens
    ``num_cached_tokens_per_seq`` (a head whose kvpress set exceeds the budget loses its lowest-scored
    entries); pages past the budget stay allocated until the request ends (the stock KV cache manager
    does not rewind them).
    """
    trtllm = process.engine_module("tensorrt_llm._torch.attention_backend.trtllm")

    def budget_of(prompt: int) -> int:
        return context_budget(prompt, keep_fraction, policy.window, policy.sink)

    class KVzapTrtllmAttentionMetadata(trtllm.TrtllmAttentionMetadata):
        def prepare(self):
            if self.kv_cache_manager is not None:
                check_whole_prompts(self.seq_lens[: self.num_contexts].tolist(), self.prompt_lens[: self.num_contexts],
                                    self.kv_cache_params.num_cached_tokens_per_seq[: self.num_contexts])
            # Generation requests attend to the budget, not the prompt (positions stay logical).
            if self.kv_cache_manager is not None:
                for i in range(self.num_contexts, self.num_contexts + self.num_generations):
                    prompt = int(self.prompt_lens[i])
                    self.kv_cache_params.num_cached_tokens_per_seq[i] += min(prompt, budget_of(prompt)) - prompt
            super().prepare()
            if self.kv_cache_manager is not None:
                n = self.num_seqs
                clamped = torch.tensor(clamp_prompt_lens(self.prompt_lens[:n], self.num_contexts, budget_of), dtype=torch.int32)
                self.prompt_lens_cpu[:n].copy_(clamped)
                self.prompt_lens_cuda[:n].copy_(self.prompt_lens_cpu[:n], non_blocking=True)
                self.prompt_lens_cpu_runtime = self.prompt_lens_cpu[:n]
                self.prompt_lens_cuda_runtime = self.prompt_lens_cuda[:n]

    class KVzapTrtllmAttention(trtllm.TrtllmAttention):
        Metadata = KVzapTrtllmAttentionMetadata

        def sparse_kv_predict(self, q, k, metadata, *args, **kwargs):
            n = metadata.num_contexts
            if n == 0:
                return None, None
            seq_lens = [int(x) for x in metadata.seq_lens[:n]]
            layer_scores = process.scorer().buffer.layers[self.layer_idx]
            return context_sparse_kv(layer_scores[: sum(seq_lens)], seq_lens, policy, keep_fraction)

        def sparse_attn_predict(self, q, k, metadata, *args, **kwargs):
            return None, None

    return KVzapTrtllmAttention


def install_sparse_kv(bundle, keep_fraction: float, mapping=None, **policy) -> type:
    """1.2.x: routes ``sparse_attention_config`` algorithm "rocket"'s slot to KVzap's attention class.

    There is no registry in 1.2.x. The two factories are bound by name where they are used, so the patch goes
    where they are looked up: ``attention_backend/utils.py`` (``get_trtllm_sparse_attn_attention_backend``, used
    by ``get_attention_backend``) and ``pyexecutor/_util.py`` (``get_sparse_attn_kv_cache_manager``), plus the
    defining ``attention_backend/sparse/utils.py``. A sparse attention config (the RocketKV one,
    ``RocketSparseAttentionConfig``, used only as the switch that enables the sparse path) then selects
    ``KVzapTrtllmAttention`` and the stock ``KVCacheManager``. Returns the class.
    """
    from kvzap_export.bundle.manifest import read_manifest

    process.engine_module("tensorrt_llm._torch.attention_backend.sparse.utils")  # the engine first: one line without it
    process.check_mapping(mapping)
    process.STATE["mapping"] = mapping
    tp_size, tp_rank = process.tp_size_rank()
    process.STATE["scorer"] = KVzapScorer.from_bundle(bundle, tp_size, tp_rank)
    pol = KVzapPolicy.from_manifest(read_manifest(bundle), decoding=False, layout="uniform", **policy)
    cls = sparse_attention_class(keep_fraction, pol)
    stock_manager = no_reuse_manager_class(process.engine_module("tensorrt_llm._torch.pyexecutor.resource_manager").KVCacheManager)
    for module in ("tensorrt_llm._torch.attention_backend.sparse.utils", "tensorrt_llm._torch.attention_backend.utils"):
        target = process.engine_module(module)
        if hasattr(target, "get_trtllm_sparse_attn_attention_backend"):
            target.get_trtllm_sparse_attn_attention_backend = lambda *args, **kwargs: cls
    # The RocketKV config only switches the sparse path on: the stock KV cache manager (no KT cache), with the
    # block-reuse refusal RocketKV's manager makes at construction.
    for module in ("tensorrt_llm._torch.attention_backend.sparse.utils", "tensorrt_llm._torch.pyexecutor._util"):
        target = process.engine_module(module)
        if hasattr(target, "get_sparse_attn_kv_cache_manager"):
            target.get_sparse_attn_kv_cache_manager = lambda *args, **kwargs: stock_manager
    process.STATE["evicts"] = False  # RoPE as for RocketKV: the metadata shortens the cached length and prompt lengths
    return cls
