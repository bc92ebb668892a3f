"""KVzap in TensorRT-LLM's PyTorch backend (``tensorrt_llm._torch``).

Targets (read from github.com/NVIDIA/TensorRT-LLM to learn names and interfaces; no code copied). The
repository's files were read at the commits below; the release number of a commit was not always
determinable, and nothing here has run inside TensorRT-LLM (see docs/integrations.md).

- **KV-cache compression framework** (after v1.2.1), pinned to commit
  ``af8c3bfaa19299dced5c411cfca1b8bd182bfd7b``: ``tensorrt_llm/_torch/pyexecutor/resource_manager.py``
  (``KVCacheCompressionManager(BaseResourceManager)``, ``__init__(self, config)``,
  ``bind_kv_cache_managers(kv_cache_manager, draft_kv_cache_manager=None)``, which needs KV cache manager V2;
  hooks ``on_request_init(request)`` / ``on_generation_step_begin(scheduled_batch)`` /
  ``on_generation_step_end(scheduled_batch)`` / ``on_request_finish(request)``),
  ``tensorrt_llm/_torch/pyexecutor/_util.py`` (``create_kv_cache_compression_manager(config,
  pretrained_config=None)``, an if-chain on ``algorithm`` looked up at call time;
  ``validate_kv_cache_compression_compatibility``), ``tensorrt_llm/llmapi/llm_args.py``
  (``KvCacheCompressionConfig``: ``algorithm``, ``changes_physical_kv_length``, ``supports_block_reuse()``,
  ``supports_speculative_decoding()``; ``kv_cache_compression_config`` validated against a union
  discriminated on ``algorithm``), ``tensorrt_llm/_torch/pyexecutor/kv_cache_manager_v2.py``
  (``get_buffers(layer_idx, kv_layout="HND")`` → ``[pages, kv_factor, kv_heads, tokens_per_block,
  head_dim]`` with global layer ids, ``get_batch_cache_indices``, ``kv_cache_map[id].resize(capacity,
  history_length) -> bool``, ``pp_layers``, ``num_extra_kv_tokens``). The first user of the framework,
  ``tensorrt_llm/_torch/kv_cache_compression/triattention/triattention.py`` @
  ``ccfe61bbe11c61e7d57b75ad91d5ad9738b5ce2d`` (``py_num_compressed_tokens``, the reserved tail of a
  resize), and the design notes ``docs/source/developer-guide/kv-cache-compression-development.md`` @
  ``ae91a87c86c38592de2bae4ded56e122cc515282``.
  The RoPE gate (RoPE must come from ``position_ids`` once entries are evicted): ``Attention.__init__``
  asks ``tensorrt_llm._torch.kv_cache_compression.compression_manager_class(algorithm)`` for
  ``physically_evicts_cached_tokens`` at ``43c2efcdd41856fd48f29cc736dfbeb40d6feb9d``; at af8c3bfa the gate
  was not found. ``attach_scorer`` therefore refuses an attention layer that still fuses RoPE.
- **v1.2.1 (tag; sparse attention framework, prototype)** — context-phase compaction only. No file could be
  read at the tag itself; names were checked against stored versions of the 1.2 design:
  ``tensorrt_llm/_torch/attention_backend/sparse/rocket.py`` @ ``0361fb11e32d6f0bf38b0851c3089945cea6a449``
  (``TrtllmAttention`` subclass with a ``Metadata`` class attribute, ``sparse_kv_predict(q, k, metadata,
  **kwargs)`` returning ``(int32 [num_kv_heads, total_selected], int32 [num_contexts + 1])``, the metadata's
  ``prepare`` shortening ``kv_cache_params.num_cached_tokens_per_seq`` and clamping ``prompt_lens_cpu`` /
  ``prompt_lens_cuda`` for generation requests), ``tensorrt_llm/_torch/attention_backend/utils.py`` @
  ``7924c7f1d3b4a3286b62c13fc890900295dc39cb`` (binds ``get_trtllm_sparse_attn_attention_backend`` at import),
  ``tensorrt_llm/_torch/pyexecutor/_util.py`` (binds ``get_sparse_attn_kv_cache_manager`` at import).
- Also read for the compaction step: ``tensorrt_llm/runtime/kv_cache_manager_v2/_core/_kv_cache.py`` @
  ``00f6bd61f297eaefd98fcabd562d3a8e3df12a96`` (``resize(capacity, history_length)``: the history never
  decreases and bounds the capacity from below; ``capacity`` / ``history_length`` properties) and
  ``tensorrt_llm/_torch/attention_backend/interface.py`` @ ``000a01de66f0eab4ab05640711f0253f50f5209c``
  (``AttentionMetadata.request_ids`` / ``seq_lens`` / ``num_contexts`` / ``is_cuda_graph``).
- Both: ``tensorrt_llm/_torch/modules/attention.py`` @ 43c2efcd (``Attention.forward(position_ids,
  hidden_states, attn_metadata, ...)``: ``hidden_states`` never reaches the backend, so KVzap scores it in a
  pre-hook into a per-layer side buffer) and ``tensorrt_llm/_torch/models/modeling_utils.py``
  (``register_auto_model``).

TensorRT-LLM cannot be installed on the machines that built this (NVIDIA's index only; it needs a GPU),
so the glue is thin and the decisions live in ``core`` (tested against kvpress). The engine-free parts
here (``KVzapScorer``, ``attach_scorer``, ``KVzapCompression``, ``move_paged_kv``, ``reserved_tail``,
``accept_config``, ``context_sparse_kv``, ``clamp_prompt_lens``) are tested on the CPU with stand-in
objects; the classes deriving from TensorRT-LLM's are built on demand and raise ``MissingDependencyError``
without it.

Registering KVzap for your model (compression framework):

    from kvzap_export.integrations import trtllm as kvzap_trtllm
    kvzap_trtllm.install("bundle/")   # manager factory + LLM args accept algorithm "kvzap"
    llm = LLM(model=..., kv_cache_config=KvCacheConfig(enable_block_reuse=False, use_kv_cache_manager_v2=True),
              kv_cache_compression_config=kvzap_trtllm.compression_config(), cuda_graph_config=None,
              disable_overlap_scheduler=True)
    kvzap_trtllm.attach_scorer(<the model's torch module>, kvzap_trtllm.scorer())   # or use kvzap_attention()

A custom model registered with ``@register_auto_model("MyArch")`` either builds its layers' attention
from ``kvzap_attention(Attention)`` (a subclass whose forward records the scores), or calls
``attach_scorer(model, scorer())`` after construction. Import the model's module before ``LLM(...)``.
See docs/integrations.md for the 1.2.x variant and the flags.

Files: ``scoring.py`` (surrogate scores per forward, the attention hooks), ``compression.py`` (step-end decisions),
``paged_kv.py`` (K/V moves in the paged cache), ``compression_manager.py`` (the framework's config, manager and
``install``), ``sparse_kv.py`` (the 1.2.x variant), ``process.py`` (what ``install`` set up in this process).
Everything public is importable from ``kvzap_export.integrations.trtllm``.
"""

from kvzap_export.integrations.trtllm.compression import KVzapCompression, skip_request
from kvzap_export.integrations.trtllm.compression_manager import (
    accept_config, compression_config, compression_config_class, compression_manager_class, install,
)
from kvzap_export.integrations.trtllm.paged_kv import (
    cache_pages, check_pool, compaction_capacity, move_paged_kv, reserved_tail,
)
from kvzap_export.integrations.trtllm.process import (
    ALGORITHM, INSTALL, TRTLLM_COMPRESSION_TARGET, TRTLLM_SPARSE_VERSION, scorer,
)
from kvzap_export.integrations.trtllm.scoring import ForwardLayout, KVzapScorer, attach_scorer, kvzap_attention
from kvzap_export.integrations.trtllm.sparse_kv import (
    check_whole_prompts, clamp_prompt_lens, context_sparse_kv, install_sparse_kv, no_reuse_manager_class,
    sparse_attention_class,
)

__all__ = [
    "ALGORITHM", "INSTALL", "TRTLLM_COMPRESSION_TARGET", "TRTLLM_SPARSE_VERSION", "ForwardLayout", "KVzapCompression",
    "KVzapScorer", "accept_config", "attach_scorer", "cache_pages", "check_pool", "check_whole_prompts",
    "clamp_prompt_lens", "compaction_capacity", "compression_config", "compression_config_class",
    "compression_manager_class", "context_sparse_kv", "install", "install_sparse_kv", "kvzap_attention",
    "move_paged_kv", "no_reuse_manager_class", "reserved_tail", "scorer", "skip_request", "sparse_attention_class",
]
