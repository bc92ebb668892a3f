"""Every SGLang 0.5.23 name the glue relies on, listed once, and the one guarded import of SGLang.

tests/integrations/sglang/test_api.py checks each entry against the real ``sglang==0.5.23`` source
(downloaded, parsed with ``ast``); the engine tests (``-m sglang``) run the glue inside that engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from kvzap_export.integrations._lazy import import_engine

SGLANG_VERSION = "0.5.23"
INSTALL = (f"pip install sglang=={SGLANG_VERSION} (on a CUDA machine; on a CPU machine: bash scripts/sglang_cpu_env.sh DIR); "
           "KVzap's SGLang glue targets that version")


@dataclass(frozen=True)
class ApiName:
    """One SGLang name the glue relies on.

    kind: "function" / "method" (called; ``params``: the leading parameter names, in order, ``self``/``cls``
    included), "property" (read as a value: a ``@property`` def), "class", "field" (class-level annotation
    or assignment, or ``self.<name> =`` in a method), "name" (any module-level binding: def, class,
    assignment, import).
    """

    module: str
    qualname: str
    kind: str
    params: tuple[str, ...] = ()

    @property
    def target(self) -> str:
        """The dotted path ``HookRegistry`` resolves."""
        return f"{self.module}.{self.qualname}"


_SB = "sglang.srt.managers.schedule_batch"
_FB = "sglang.srt.model_executor.forward_batch_info"
_FLEX = "sglang.srt.layers.attention.torch_flex_backend"
_NATIVE = "sglang.srt.layers.attention.torch_native_backend"
_BASE_ATTN = "sglang.srt.layers.attention.base_attn_backend"
_SCHED = "sglang.srt.managers.scheduler"
_POOL = "sglang.srt.mem_cache.memory_pool"
_RADIX = "sglang.srt.mem_cache.radix_cache"
_GRAPHS = "sglang.srt.model_executor.runner.decode_cuda_graph_runner"

SGLANG_API: tuple[ApiName, ...] = (
    # plugin hooks
    ApiName("sglang.srt.plugins.hook_registry", "HookRegistry.register", "method", ("cls", "target", "hook", "hook_type")),
    ApiName("sglang.srt.plugins.hook_registry", "HookType.BEFORE", "field"),
    ApiName("sglang.srt.plugins.hook_registry", "HookType.AFTER", "field"),
    ApiName("sglang.srt.plugins.hook_registry", "HookType.AROUND", "field"),
    # scoring: the attention modules whose forward receives the post-norm hidden states
    ApiName("sglang.srt.models.llama", "LlamaAttention.forward", "method", ("self", "positions", "hidden_states", "forward_batch")),
    ApiName("sglang.srt.models.llama", "LlamaAttention.attn", "field"),
    ApiName("sglang.srt.models.qwen3", "Qwen3Attention.forward", "method", ("self", "positions", "hidden_states", "forward_batch")),
    ApiName("sglang.srt.models.qwen3", "Qwen3Attention.attn", "field"),
    ApiName("sglang.srt.layers.radix_attention", "RadixAttention.layer_id", "field"),
    ApiName("sglang.srt.layers.radix_attention", "RadixAttention.tp_q_head_num", "field"),
    ApiName("sglang.srt.layers.radix_attention", "RadixAttention.tp_k_head_num", "field"),
    ApiName("sglang.srt.layers.radix_attention", "RadixAttention.scaling", "field"),
    ApiName("sglang.srt.layers.radix_attention", "RadixAttention.is_cross_attention", "field"),
    ApiName("sglang.srt.layers.radix_attention", "RadixAttention.sliding_window_size", "field"),
    # forward batch
    ApiName(_FB, "ForwardBatch.init_new", "method", ("cls", "batch", "model_runner")),
    ApiName(_FB, "ForwardBatch.forward_mode", "field"),
    ApiName(_FB, "ForwardBatch.out_cache_loc", "field"),
    ApiName(_FB, "ForwardBatch.req_pool_indices", "field"),
    ApiName(_FB, "ForwardBatch.seq_lens", "field"),
    ApiName(_FB, "ForwardBatch.positions", "field"),
    ApiName(_FB, "ForwardBatch.extend_seq_lens", "field"),
    ApiName(_FB, "ForwardBatch.extend_prefix_lens", "field"),
    ApiName(_FB, "ForwardMode.is_extend", "method", ("self",)),
    ApiName(_FB, "ForwardMode.is_decode", "method", ("self",)),
    # launch check and step end
    ApiName(_SCHED, "Scheduler.__init__", "method", ("self", "server_args", "port_args")),
    ApiName(_SCHED, "Scheduler.run_batch", "method", ("self", "batch", "pp_proxy_tensors")),
    ApiName(_SCHED, "Scheduler.chunked_req", "field"),
    ApiName(_SCHED, "Scheduler.running_batch", "field"),
    ApiName(_SB, "ScheduleBatch.batch_is_full", "field"),
    ApiName(_SCHED, "Scheduler.on_idle", "method", ("self",)),
    # KVzap's figures in SGLang's internal state (``/server_info``'s ``internal_states``, one per data-parallel replica)
    ApiName(_SCHED, "Scheduler.get_internal_state", "method", ("self", "recv_req")),
    ApiName("sglang.srt.managers.io_struct", "GetInternalStateReqOutput.internal_state", "field"),
    ApiName(_SCHED, "Scheduler.is_fully_idle", "method", ("self",)),
    # ragged mode sets the flattened decode path's step buffers aside before sizing the pool (ragged_budget.budget_hook)
    ApiName("sglang.srt.mem_cache.kv_cache_configurator", "KVCacheConfigurator.resolve_max_num_reqs", "method",
            ("self", "token_capacity")),
    ApiName("sglang.srt.model_executor.pool_configurator", "MemoryPoolConfig.max_total_num_tokens", "field"),
    ApiName("sglang.srt.configs.model_config", "ModelConfig.get_num_kv_heads", "method", ("self", "tensor_parallel_size")),
    ApiName("sglang.srt.configs.model_config", "ModelConfig.num_hidden_layers", "field"),
    ApiName("sglang.srt.arg_groups.fields.exec_", "ExecGraph.cuda_graph_config", "field"),
    # ragged mode learns its exact free count where SGLang acts on a short one (ragged_pool.allocator_class)
    ApiName("sglang.srt.mem_cache.allocator.base", "BaseTokenToKVPoolAllocator.evict_to_free_tokens", "method",
            ("self", "tree_cache", "num_tokens")),
    ApiName("sglang.srt.mem_cache.allocator.base", "BaseTokenToKVPoolAllocator.check_decode_capacity", "method",
            ("self",)),
    ApiName(_SB, "ScheduleBatch.reqs", "field"),
    ApiName(_SB, "ScheduleBatch.forward_mode", "field"),
    ApiName(_SB, "ScheduleBatch.req_to_token_pool", "field"),
    ApiName(_SB, "ScheduleBatch.token_to_kv_pool_allocator", "field"),
    ApiName(_SB, "ScheduleBatch.seq_lens", "field"),
    ApiName(_SB, "ScheduleBatch.seq_lens_cpu", "field"),
    ApiName(_SB, "ScheduleBatch.orig_seq_lens", "field"),
    ApiName(_SB, "ScheduleBatch.seq_lens_sum", "field"),
    ApiName(_SB, "ScheduleBatch.prefix_lens", "field"),
    ApiName(_SB, "ScheduleBatch.extend_lens", "field"),
    ApiName(_SB, "Req.kv", "field"),
    ApiName(_SB, "Req.rid", "field"),
    ApiName(_SB, "Req.origin_input_ids", "field"),
    ApiName(_SB, "Req.output_ids", "field"),
    ApiName(_SB, "Req.sampling_params", "field"),
    ApiName(_SB, "Req.finished", "method", ("self",)),
    ApiName(_SB, "Req.beam_group", "field"),
    ApiName(_SB, "Req.to_finish", "field"),
    ApiName(_SB, "FINISH_ABORT.__init__", "method", ("self", "message", "status_code", "err_type")),
    ApiName(_SB, "Req.session", "field"),
    ApiName("sglang.srt.sampling.sampling_params", "SamplingParams.custom_params", "field"),
    ApiName("sglang.srt.session.session_controller", "Session.streaming", "field"),
    ApiName(_SB, "ReqKvInfo.req_pool_idx", "field"),
    ApiName(_SB, "ReqKvInfo.kv_committed_len", "field"),
    ApiName(_SB, "ReqKvInfo.kv_allocated_len", "field"),
    # memory pools
    ApiName(_POOL, "ReqToTokenPool.req_to_token", "field"),
    ApiName(_POOL, "MHATokenToKVPool.get_key_buffer", "method", ("self", "layer_id")),
    ApiName(_POOL, "MHATokenToKVPool.get_value_buffer", "method", ("self", "layer_id")),
    ApiName(_POOL, "MHATokenToKVPool.set_kv_buffer", "method", ("self", "layer", "loc_info", "cache_k", "cache_v")),
    ApiName("sglang.srt.mem_cache.allocator.base", "BaseTokenToKVPoolAllocator.free", "method", ("self", "free_index")),
    ApiName("sglang.srt.mem_cache.allocator.base", "BaseTokenToKVPoolAllocator.get_kvcache", "method", ("self",)),
    ApiName("sglang.srt.mem_cache.allocator.base", "BaseTokenToKVPoolAllocator.available_size", "method", ("self",)),
    ApiName("sglang.srt.mem_cache.allocator.base", "BaseTokenToKVPoolAllocator.size", "field"),
    ApiName(_POOL, "KVCache.size", "field"),
    ApiName(_POOL, "KVCache.page_size", "field"),
    ApiName(_POOL, "KVCache.dtype", "field"),
    ApiName(_POOL, "MHATokenToKVPool.is_quantized_kv_cache", "property"),
    # server setup checked at the first step end (ServerSetup)
    ApiName(_SCHED, "Scheduler.tree_cache", "field"),
    ApiName(_SCHED, "Scheduler.enable_pdmux", "field"),
    ApiName("sglang.srt.arg_groups.fields.exec_", "ExecOverlap.enable_two_batch_overlap", "field"),
    ApiName(_SCHED, "Scheduler.enable_overlap", "field"),
    ApiName(_SCHED, "Scheduler.forward_stream", "field"),
    ApiName(_SCHED, "Scheduler.schedule_stream", "field"),
    ApiName(_SCHED, "Scheduler.device_module", "field"),
    ApiName(_SCHED, "Scheduler.page_size", "field"),
    ApiName(_SCHED, "Scheduler.spec_algorithm", "field"),
    ApiName(_SCHED, "Scheduler.is_mixed_chunk", "field"),
    ApiName(_SCHED, "Scheduler.token_to_kv_pool_allocator", "field"),
    ApiName("sglang.srt.mem_cache.unified_radix_cache", "UnifiedRadixCache.disable", "field"),
    ApiName("sglang.srt.speculative.spec_info", "SpeculativeAlgorithm.is_none", "method", ("self",)),
    ApiName("sglang.srt.runtime_context", "get_memory", "function", ()),
    ApiName("sglang.srt.runtime_context", "get_parallel", "function", ()),
    ApiName("sglang.srt.runtime_context", "get_disagg", "function", ()),
    ApiName("sglang.srt.runtime_context", "get_exec", "function", ()),
    ApiName("sglang.srt.model_executor.cuda_graph_config", "check_cuda_graph_backend", "function", ("phase", "backend")),
    # ragged mode turns SGLang's default prefill graphs off (server_setup.prefill_graphs_default)
    ApiName("sglang.srt.arg_groups.resolution_hooks", "register_resolution_hook", "function", ("name",)),
    ApiName("sglang.srt.arg_groups.cuda_graph_hook", "handle_cuda_graph_config", "function", ("server_args",)),
    ApiName("sglang.srt.arg_groups.overrides", "declare_resolution", "name"),
    ApiName("sglang.srt.arg_groups.overrides", "resolving_view", "name"),
    ApiName("sglang.srt.model_executor.cuda_graph_config", "with_phase", "function", ("config", "phase")),
    ApiName("sglang.srt.model_executor.cuda_graph_config", "Phase.PREFILL", "field"),
    ApiName("sglang.srt.model_executor.cuda_graph_config", "Backend.DISABLED", "field"),
    ApiName("sglang.srt.model_executor.model_runner", "ModelRunner.init_cuda_graphs", "method",
            ("self", "capture_decode_cuda_graph")),
    ApiName("sglang.srt.arg_groups.fields.exec_", "ExecKernel.attention_backend", "field"),
    ApiName("sglang.srt.arg_groups.fields.exec_", "ExecGraph.enable_torch_compile", "field"),
    ApiName("sglang.srt.arg_groups.fields.exec_", "ExecKernel.decode_attention_backend", "field"),
    ApiName("sglang.srt.arg_groups.fields.exec_", "ExecKernel.prefill_attention_backend", "field"),
    ApiName("sglang.srt.arg_groups.fields.memory", "Memory.enable_unified_memory", "field"),
    ApiName("sglang.srt.arg_groups.fields.parallel", "Parallel.dcp_size", "field"),
    ApiName("sglang.srt.arg_groups.fields.parallel", "Parallel.tp_size", "field"),
    ApiName("sglang.srt.arg_groups.fields.parallel", "Parallel.pp_size", "field"),
    ApiName("sglang.srt.arg_groups.fields.parallel", "Parallel.attn_dp_size", "field"),
    ApiName("sglang.srt.arg_groups.fields.parallel", "Parallel.dp_rank", "field"),
    ApiName("sglang.srt.arg_groups.fields.disagg", "Disagg.disaggregation_mode", "field"),
    # tensor parallelism
    ApiName("sglang.srt.distributed.parallel_state", "get_tp_group", "function", ()),
    ApiName("sglang.srt.distributed.parallel_state", "GroupCoordinator.cpu_group", "field"),
    ApiName("sglang.srt.distributed.parallel_state", "GroupCoordinator.world_size", "field"),
    ApiName("sglang.srt.distributed.parallel_state", "GroupCoordinator.rank_in_group", "field"),
    ApiName("sglang.srt.configs.model_config", "ModelConfig.get_total_num_kv_heads", "method", ("self",)),
    # masking backends
    ApiName("sglang.srt.layers.attention.attention_registry", "register_attention_backend", "function", ("name",)),
    ApiName("sglang.srt.arg_groups.choices", "add_attention_backend_choices", "name"),
    ApiName(_FLEX, "TorchFlexAttnBackend", "class"),
    ApiName(_FLEX, "TorchFlexAttnBackend.__init__", "method", ("self", "model_runner")),
    ApiName(_FLEX, "TorchFlexAttnBackend.forward_decode", "method", ("self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache")),
    ApiName(_FLEX, "TorchFlexAttnBackend.decode_block_masks", "field"),
    ApiName(_FLEX, "TorchFlexAttnBackend.device", "field"),
    ApiName(_NATIVE, "TorchNativeAttnBackend", "class"),
    ApiName(_NATIVE, "TorchNativeAttnBackend.__init__", "method", ("self", "model_runner")),
    ApiName(_NATIVE, "TorchNativeAttnBackend.forward_decode", "method", ("self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache")),
    ApiName(_NATIVE, "TorchNativeAttnBackend.token_to_kv_pool", "field"),
    ApiName(_NATIVE, "TorchNativeAttnBackend.req_to_token_pool", "field"),
    ApiName(_NATIVE, "TorchNativeAttnBackend.use_sliding_window_kv_pool", "field"),
    ApiName(_NATIVE, "TorchNativeAttnBackend.forward_extend", "method", ("self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache")),
    # ragged mode: SGLang's pool, allocator and request pool built through these
    ApiName("sglang.srt.platforms.interface", "SRTPlatform.get_kv_pool_cls", "method", ("self", "kind")),
    ApiName("sglang.srt.mem_cache.kv_cache_configurator", "KVCacheConfigurator._build_token_to_kv_pool_allocator",
            "method", ("self", "sizes", "token_to_kv_pool", "is_dsv4_model", "req_to_token_pool")),
    ApiName("sglang.srt.mem_cache.kv_cache_configurator", "_PoolSizes.max_total_num_tokens", "field"),
    ApiName("sglang.srt.mem_cache.kv_cache_configurator", "KVCacheConfigurator.config_from_budget", "method",
            ("self", "budget_bytes")),
    ApiName("sglang.srt.mem_cache.kv_cache_configurator", "KVCacheConfigurator.model_config", "field"),
    ApiName("sglang.srt.mem_cache.kv_cache_configurator", "KVCacheConfigurator.kv_cache_dtype", "field"),
    ApiName("sglang.srt.mem_cache.kv_cache_configurator", "KVCacheConfigurator.device", "field"),
    ApiName("sglang.srt.beam_search.coordinator", "BeamCoordinator.validate_and_init", "method", ("self", "req", "recv_req")),
    ApiName(_POOL, "NoOpMHATokenToKVPool", "class"),
    # ragged mode's decode CUDA graphs (DecodeCudaGraphRunner calls these on the backend)
    ApiName(_BASE_ATTN, "AttentionBackend.init_cuda_graph_state", "method", ("self", "max_bs", "max_num_tokens")),
    ApiName(_BASE_ATTN, "AttentionBackend.get_cuda_graph_seq_len_fill_value", "method", ("self",)),
    ApiName(_BASE_ATTN, "AttentionBackend.init_forward_metadata_out_graph", "method",
            ("self", "forward_batch", "in_capture")),
    # a decode step whose rows share more ids than the graphs' buffer runs eagerly (ragged_decode.graph_fits_hook)
    ApiName(_GRAPHS, "DecodeCudaGraphRunner.can_run_graph", "method", ("self", "forward_batch")),
    # ragged mode skips SGLang's FlashInfer autotune (server_setup.autotune_hook): its dummy forward has no layout
    ApiName("sglang.srt.model_executor.runner.flashinfer_autotune", "should_run_flashinfer_autotune", "function",
            ("model_runner",)),
    ApiName(_POOL, "ReqToTokenPool.size", "field"),
    ApiName(_POOL, "NoOpMHATokenToKVPool._finalize_allocation_log", "method", ("self", "num_tokens")),
    ApiName(_POOL, "MHATokenToKVPool.layer_num", "field"),
    ApiName(_POOL, "MHATokenToKVPool.head_num", "field"),
    ApiName(_POOL, "MHATokenToKVPool.head_dim", "field"),
    ApiName(_POOL, "MHATokenToKVPool.v_head_dim", "field"),
    ApiName(_POOL, "KVCache.store_dtype", "field"),
    ApiName(_POOL, "KVCache.device", "field"),
    ApiName(_POOL, "KVCache.mem_usage", "field"),
    ApiName(_POOL, "ReqToTokenPool.attach_aux_cache", "method", ("self", "aux_cache")),
    ApiName(_POOL, "ReqToTokenPool._aux_cache", "field"),
    ApiName(_POOL, "ReqToTokenPool.alloc_aux_to_lengths", "method", ("self",)),
    ApiName(_POOL, "ReqToTokenPool.free_rows", "method", ("self",)),
    ApiName(_POOL, "ReqToTokenPool.schedulable_token_capacity", "method", ("self", "physical_capacity")),
    ApiName("sglang.srt.mem_cache.allocator.token", "TokenToKVPoolAllocator", "class"),
    ApiName("sglang.srt.mem_cache.allocator.token", "TokenToKVPoolAllocator.__init__", "method",
            ("self", "size", "dtype", "device", "kvcache", "need_sort")),
    ApiName("sglang.srt.mem_cache.allocator.token", "TokenToKVPoolAllocator.available_size", "method", ("self",)),
    ApiName("sglang.srt.mem_cache.allocator.token", "TokenToKVPoolAllocator.alloc", "method", ("self", "need_size")),
    ApiName("sglang.srt.mem_cache.allocator.token", "TokenToKVPoolAllocator.free_pages", "field"),
    ApiName("sglang.srt.mem_cache.allocator.base", "BaseTokenToKVPoolAllocator.device", "field"),
    ApiName(_POOL, "MHATokenToKVPool.get_kv_size_bytes", "method", ("self",)),
    ApiName(_NATIVE, "TorchNativeAttnBackend.init_forward_metadata", "method", ("self", "forward_batch")),
    ApiName(_NATIVE, "TorchNativeAttnBackend.device", "field"),
    ApiName(_FB, "ForwardBatch.batch_size", "field"),
    ApiName(_FB, "ForwardBatch.seq_lens_cpu", "field"),
    ApiName(_FB, "ForwardBatch.extend_prefix_lens_cpu", "field"),
    ApiName(_FB, "ForwardBatch.extend_seq_lens_cpu", "field"),
    ApiName("sglang.srt.layers.radix_attention", "RadixAttention.qk_head_dim", "field"),
    ApiName("sglang.srt.layers.radix_attention", "RadixAttention.v_head_dim", "field"),
    ApiName("sglang.srt.model_executor.model_runner", "ModelRunner.token_to_kv_pool_allocator", "field"),
    ApiName("sglang.srt.model_executor.model_runner", "ModelRunner.req_to_token_pool", "field"),
    ApiName("sglang.srt.model_executor.model_runner", "ModelRunner.model_config", "field"),
    ApiName("sglang.srt.configs.model_config", "ModelConfig.num_attention_heads", "field"),
    ApiName("sglang.srt.configs.model_config", "ModelConfig.head_dim", "field"),
    ApiName("sglang.srt.configs.model_config", "ModelConfig.v_head_dim", "field"),
    # the offline engine the driver runs (validate --engine, bench --engine)
    ApiName("sglang", "Engine", "name"),
    ApiName("sglang.srt.entrypoints.engine", "Engine.generate", "method", ("self", "prompt", "sampling_params", "input_ids")),
    ApiName("sglang.srt.entrypoints.engine", "Engine.async_generate", "method", ("self", "prompt", "sampling_params", "input_ids")),
    ApiName("sglang.srt.entrypoints.engine", "Engine.shutdown", "method", ("self",)),
    ApiName("sglang.srt.entrypoints.engine", "Engine.tokenizer_manager", "field"),
    ApiName("sglang.srt.entrypoints.engine", "Engine.loop", "field"),
    ApiName("sglang.srt.entrypoints.engine", "Engine.server_args", "field"),
    ApiName("sglang.srt.server_args", "ServerArgs.resolved_dict", "method", ("self",)),
    ApiName("sglang.srt.mem_cache.base_prefix_cache", "BasePrefixCache.evictable_size", "method", ("self",)),
    # ragged mode with the radix cache on (ragged_radix.py): SGLang's tree subclassed, built through create_tree_cache
    ApiName("sglang.srt.mem_cache.registry", "create_tree_cache", "function", ("ctx",)),
    ApiName("sglang.srt.mem_cache.registry", "TreeCacheBuildContext.params", "field"),
    ApiName("sglang.srt.mem_cache.registry", "TreeCacheBuildContext.disable_radix_cache", "field"),
    ApiName("sglang.srt.mem_cache.allocation", "alloc_for_extend", "function", ("batch",)),
    ApiName("sglang.srt.arg_groups.fields.memory", "Memory.disable_radix_cache", "field"),
    ApiName("sglang.srt.arg_groups.fields.memory", "Memory.radix_cache_backend", "field"),
    ApiName("sglang.srt.arg_groups.fields.memory", "Memory.enable_hierarchical_cache", "field"),
    ApiName("sglang.srt.arg_groups.fields.memory", "Memory.enable_lmcache", "field"),
    ApiName("sglang.srt.arg_groups.fields.memory", "Memory.enable_flexkv", "field"),
    ApiName("sglang.srt.arg_groups.fields.memory", "Memory.enable_unified_cache_external_linker", "field"),
    ApiName("sglang.srt.arg_groups.fields.memory", "Memory.enable_session_radix_cache", "field"),
    ApiName("sglang.srt.arg_groups.fields.memory", "Memory.radix_eviction_policy", "field"),
    ApiName("sglang.srt.arg_groups.fields.serving", "Serving.enable_streaming_session", "field"),
    ApiName("sglang.srt.runtime_context", "get_serving", "function", ()),
    ApiName("sglang.srt.mem_cache.base_prefix_cache", "BasePrefixCache.lock", "method", ("self", "node")),
    ApiName(_RADIX, "RadixCache.path_device_indices", "method", ("self", "node")),
    ApiName(_RADIX, "RadixCache", "class"),
    ApiName(_RADIX, "RadixCache.__init__", "method", ("self", "params")),
    ApiName(_RADIX, "RadixCache.reset", "method", ("self",)),
    ApiName(_RADIX, "RadixCache._match_prefix_helper", "method", ("self", "node", "key")),
    ApiName(_RADIX, "RadixCache._split_node", "method", ("self", "key", "child", "split_len")),
    ApiName(_RADIX, "RadixCache.checkpoint", "method", ("self", "req")),
    ApiName(_RADIX, "RadixCache.evict", "method", ("self", "params")),
    ApiName(_RADIX, "RadixCache._update_leaf_status", "method", ("self", "node")),
    ApiName(_RADIX, "RadixCache.evictable_size_", "field"),
    ApiName(_RADIX, "RadixCache.protected_size_", "field"),
    ApiName(_RADIX, "RadixCache.evictable_leaves", "field"),
    ApiName(_RADIX, "RadixCache.root_node", "field"),
    ApiName(_RADIX, "RadixCache.page_size", "field"),
    ApiName(_RADIX, "RadixCache.kv_events", "field"),
    ApiName(_RADIX, "RadixCache.token_to_kv_pool_allocator", "field"),
    ApiName(_RADIX, "TreeNode.children", "field"),
    ApiName(_RADIX, "TreeNode.parent", "field"),
    ApiName(_RADIX, "TreeNode.key", "field"),
    ApiName(_RADIX, "TreeNode.value", "field"),
    ApiName(_RADIX, "TreeNode.lock_ref", "field"),
    ApiName(_RADIX, "TreeNode.last_access_time", "field"),
    ApiName(_RADIX, "RadixKey.child_key", "method", ("self", "page_size")),
    ApiName(_RADIX, "RadixKey.match", "method", ("self", "other", "page_size")),
    ApiName("sglang.srt.mem_cache.base_prefix_cache", "BasePrefixCache.unlock", "method", ("self", "lock")),
    ApiName("sglang.srt.mem_cache.base_prefix_cache", "BasePrefixCache.full_evictable_size", "method", ("self",)),
    ApiName("sglang.srt.mem_cache.base_prefix_cache", "BasePrefixCache.full_protected_size", "method", ("self",)),
    ApiName("sglang.srt.mem_cache.base_prefix_cache", "EvictParams.num_tokens", "field"),
    ApiName("sglang.srt.mem_cache.events", "KVCacheEventRecorder.record_remove", "method", ("self", "node")),
    ApiName("sglang.srt.mem_cache.allocator.base", "BaseTokenToKVPoolAllocator.free_group", "field"),
    ApiName("sglang.srt.mem_cache.allocator.base", "BaseTokenToKVPoolAllocator.free_group_begin", "method", ("self",)),
    ApiName("sglang.srt.mem_cache.allocator.base", "BaseTokenToKVPoolAllocator.free_group_end", "method", ("self",)),
    ApiName("sglang.srt.mem_cache.allocator.token", "TokenToKVPoolAllocator.clear", "method", ("self",)),
    ApiName("sglang.srt.mem_cache.allocator.token", "TokenToKVPoolAllocator.free", "method", ("self", "free_index")),
    ApiName(_SB, "Req.skip_radix_cache_insert", "field"),
    # ... and under the overlap scheduler, holding back requests an in-flight prefill will let hit (prefill_hold_hook)
    ApiName(_SCHED, "Scheduler.get_new_batch_prefill", "method", ("self", "running_batch")),
    ApiName(_SCHED, "Scheduler.waiting_queue", "field"),
    ApiName(_SCHED, "Scheduler.result_queue", "field"),
    ApiName(_SB, "Req.prefix_len", "field"),
    ApiName(_SB, "Req.extend_end", "field"),
    ApiName(_SB, "Req.full_untruncated_fill_ids", "field"),
    ApiName(_SB, "Req.extra_key", "field"),
    ApiName(_SB, "Req.cache_salt", "field"),
    ApiName(_SB, "Req._compute_max_prefix_len", "method", ("self", "input_len")),
    ApiName(_SCHED, "Scheduler.max_queued_requests", "field"),
    ApiName(_SCHED, "Scheduler.max_running_requests", "field"),
    ApiName(_SCHED, "Scheduler.enable_priority_preemption", "field"),
    ApiName(_SCHED, "Scheduler.grammar_manager", "field"),
    ApiName("sglang.srt.constrained.grammar_manager", "GrammarManager.has_waiting_grammars", "method", ("self",)),
    ApiName(_SB, "ScheduleBatch.is_empty", "method", ("self",)),
    ApiName(_SB, "ScheduleBatch.out_cache_loc", "field"),
    ApiName(_SB, "ReqKvInfo.cache_protected_len", "field"),
    ApiName("sglang.srt.managers.tokenizer_manager", "TokenizerManager.abort_request", "method", ("self", "rid")),
    ApiName("sglang.srt.managers.tokenizer_manager", "TokenizerManager.tokenizer", "field"),
)

# What SGLang's ReqToTokenPool calls on an attached aux cache (ragged_rows.StoreRows implements it): checked in the
# 0.5.23 source of ``ReqToTokenPool`` by tests/integrations/sglang/test_api.py.
AUX_CACHE_PROTOCOL = ("alloc_to_lengths(", "req_pool_indices_cpu=", "target_seq_lens_cpu=", ".free(", ".clear()",
                      ".reset_allocator()", ".dense_capacity")

_API = MappingProxyType({api.qualname: api for api in SGLANG_API})
# The attention classes whose forward the scoring hook wraps (add yours: same (positions, hidden_states,
# forward_batch) signature and an ``attn`` RadixAttention).
SCORED_ATTENTION = ("LlamaAttention.forward", "Qwen3Attention.forward")


def api(qualname: str) -> ApiName:
    return _API[qualname]


def sglang_module(module: str):
    """``import module`` of SGLang, or one line saying how to install it."""
    return import_engine(module, "KVzap's SGLang integration", INSTALL)
