"""TensorRT-LLM's KV-cache compression framework (after v1.2.1): KVzap's config, its resource manager, and
``install``, which makes ``algorithm="kvzap"`` build it. Engine-bound: the classes derive from TensorRT-LLM's."""

from __future__ import annotations

import torch

from kvzap_export.errors import ConfigError, MissingDependencyError
from kvzap_export.integrations.core import KVzapPolicy
from kvzap_export.integrations.trtllm import process
from kvzap_export.integrations.trtllm.compression import KVzapCompression, skip_request
from kvzap_export.integrations.trtllm.paged_kv import (
    cache_pages, check_pool, compaction_capacity, move_paged_kv, reserved_tail,
)
from kvzap_export.integrations.trtllm.process import ALGORITHM
from kvzap_export.integrations.trtllm.scoring import KVzapScorer


def accept_config(models, config_cls: type, field: str = "kv_cache_compression_config") -> list[type]:
    """Lets pydantic models whose ``field`` is a union of known configs (discriminated on ``algorithm``)
    accept ``config_cls`` too; returns the models changed. Idempotent.

    TensorRT-LLM's ``LLM(...)`` validates ``kv_cache_compression_config`` against the union of its own
    algorithms; without this, a config with ``algorithm="kvzap"`` is rejected before any manager is built.
    """
    from typing import Optional, Union

    changed = []
    for model in models:
        fields = getattr(model, "model_fields", None)
        if not isinstance(fields, dict) or field not in fields:
            continue
        accepted = getattr(model, "__kvzap_accepts__", ())
        if config_cls in accepted and model.__dict__.get("__kvzap_accepts__") is accepted:
            continue
        info = fields[field]
        info.annotation = Optional[Union[config_cls, info.annotation]]
        model.__kvzap_accepts__ = (*accepted, config_cls)
        model.model_rebuild(force=True)
        changed.append(model)
    return changed



def world_max(counts: list[int]) -> list[int]:
    """Every tensor-parallel rank keeps the largest count: one KV length per request.

    The ranks schedule the same requests in the same order (no attention data parallelism, checked by
    ``install``), so the per-request lists line up; the communicator is the one TensorRT-LLM's resource
    manager uses (``tensorrt_llm._utils.mpi_comm``, or torch.distributed when MPI is disabled).
    """
    utils = process.engine_module("tensorrt_llm._utils")
    if utils.mpi_disabled():
        t = torch.tensor(counts, dtype=torch.int64, device="cuda")
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return t.tolist()
    import numpy as np
    from mpi4py import MPI

    values = np.asarray(counts, dtype=np.int64)
    utils.mpi_comm().Allreduce(MPI.IN_PLACE, values, op=MPI.MAX)
    return values.tolist()


def compression_config_class() -> type:
    """``KvCacheCompressionConfig`` subclass for KVzap: physical length changes; no block reuse; no speculation."""
    if "config_class" in process.STATE:
        return process.STATE["config_class"]
    llm_args = process.engine_module("tensorrt_llm.llmapi.llm_args")
    from typing import ClassVar, Literal

    class KVzapCompressionConfig(llm_args.KvCacheCompressionConfig):
        changes_physical_kv_length: ClassVar[bool] = True
        algorithm: Literal["kvzap"] = ALGORITHM

        def supports_block_reuse(self) -> bool:
            return False  # compacted blocks no longer hold the token ids they were hashed under

        def supports_speculative_decoding(self) -> bool:
            return False  # draft tokens' K/V and the reserved tail are not handled by the step-end moves

    process.STATE["config_class"] = KVzapCompressionConfig
    return KVzapCompressionConfig


def compression_config():
    """The ``kv_cache_compression_config`` to pass to ``LLM(...)`` (``install`` must run first)."""
    return compression_config_class()(algorithm=ALGORITHM)


def accept_in_llm_args() -> None:
    """``LLM(...)`` validates ``kv_cache_compression_config`` against a union of TensorRT-LLM's algorithms."""
    import inspect

    llm_args = process.engine_module("tensorrt_llm.llmapi.llm_args")
    models = [obj for _, obj in inspect.getmembers(llm_args, inspect.isclass) if obj.__module__ == llm_args.__name__]
    if not accept_config(models, compression_config_class()) and not any(
            "kv_cache_compression_config" in getattr(m, "model_fields", {}) for m in models):
        raise ConfigError("this TensorRT-LLM's LLM arguments have no kv_cache_compression_config (the KV-cache "
                          "compression framework came after v1.2.1); use the 1.2.x variant: install_sparse_kv()")


def compression_manager_class() -> type:
    """The resource manager TensorRT-LLM drives (pinned API: ``KVCacheCompressionManager`` @ af8c3bfa)."""
    rm = process.engine_module("tensorrt_llm._torch.pyexecutor.resource_manager")
    base = getattr(rm, "KVCacheCompressionManager", None)
    if base is None or not hasattr(base, "bind_kv_cache_managers"):
        raise ConfigError("this TensorRT-LLM has no KVCacheCompressionManager with bind_kv_cache_managers (the API "
                          "KVzap targets, NVIDIA/TensorRT-LLM@af8c3bfa); use a build with it, or the 1.2.x variant: "
                          "install_sparse_kv()")

    class KVzapCompressionManager(base):
        # Read by the attention module's RoPE gate where it exists (kv_cache_compression.compression_manager_class,
        # @43c2efcd): a method that evicts physically needs RoPE from position_ids, not from the cached length.
        physically_evicts_cached_tokens = True

        def __init__(self, config, policy: KVzapPolicy):
            super().__init__(config)  # the KV cache managers are bound later (bind_kv_cache_managers)
            self._prepared = None
            self.kvzap = KVzapCompression(process.scorer(), policy, mover=self._move,
                                          agree=world_max if process.STATE.get("world", 1) > 1 else None,
                                          skip=skip_request, hold=self._inactive)

        def on_request_init(self, request, **kwargs):
            self.kvzap.request_init(request)

        def on_generation_step_begin(self, scheduled_batch, **kwargs):
            self._prepared = scheduled_batch  # under the overlap scheduler: the batch after the one ending next

        def on_generation_step_end(self, scheduled_batch, **kwargs):
            if self._prepared is not None and self._prepared is not scheduled_batch:
                # prepare_resources (-> step begin) runs for every batch before its forward, update_resources
                # (-> step end) after it: another batch begun in between is the overlap scheduler's.
                raise ConfigError("KVzap needs the overlap scheduler off (the next forward would write K/V and "
                                  "scores while this step compacts): build the LLM with disable_overlap_scheduler=True")
            self.kvzap.step_end(scheduled_batch.context_requests, scheduled_batch.context_requests_last_chunk,
                                scheduled_batch.generation_requests)

        def on_request_finish(self, request, **kwargs):
            self.kvzap.request_finish(request)  # the KV cache manager frees the blocks

        def _manager(self):
            if self.kv_cache_manager is None:
                raise ConfigError("KVzap's compression manager is not bound to a KV cache manager: enable KV cache "
                                  "manager V2 (KvCacheConfig(use_kv_cache_manager_v2=True))")
            return self.kv_cache_manager

        def _inactive(self, request) -> bool:
            cache = self._manager().kv_cache_map.get(request.py_request_id)
            return cache is None or not getattr(cache, "is_active", True)

        def _move(self, request, decision) -> None:
            manager = self._manager()
            rid = request.py_request_id
            cache = manager.kv_cache_map[rid]
            # Everything that can refuse is checked before the first byte moves.
            capacity = compaction_capacity(decision.uniform_count, reserved_tail(manager), int(cache.history_length))
            before = int(decision.physical_before.max())
            layers = list(getattr(manager, "pp_layers", range(decision.indices.shape[0])))  # global layer ids
            moves = []
            for layer in layers:
                pool = manager.get_buffers(layer, kv_layout="HND")
                check_pool(pool, decision.indices.shape[1], layer)
                moves.append((pool, cache_pages(manager, rid, layer, before, pool.shape[3]), decision.indices[layer]))
            for pool, pages, indices in moves:
                move_paged_kv(pool, pages, indices)
            # The cache manager releases pages on its own stream: it must not overtake the moves.
            stream = getattr(manager, "_stream", None)
            if stream is not None and stream != torch.cuda.current_stream():
                done = torch.cuda.Event()
                done.record()
                stream.wait_event(done)
            # The compacted length is published through py_num_compressed_tokens (set by the caller).
            if capacity < int(cache.capacity) and not cache.resize(capacity, None):
                raise RuntimeError(f"request {rid}: TensorRT-LLM refused to resize its KV cache to {capacity} tokens")

    return KVzapCompressionManager


def install(bundle, mapping=None, decoding: bool = True, **policy) -> KVzapScorer:
    """Loads the bundle's surrogate and makes ``algorithm="kvzap"`` build KVzap's compression manager.

    Call before the model is built (its attention layers read the RoPE gate at construction).
    mapping: TensorRT-LLM's ``Mapping`` of this rank (tensor-parallel head slice); None = one GPU.
    """
    from kvzap_export.bundle.manifest import read_manifest

    util = process.engine_module("tensorrt_llm._torch.pyexecutor._util")
    process.check_mapping(mapping)
    process.STATE["mapping"] = mapping
    process.STATE["world"] = mapping.tp_size if mapping is not None else 1
    tp_size, tp_rank = process.tp_size_rank()
    process.STATE["scorer"] = KVzapScorer.from_bundle(bundle, tp_size, tp_rank)
    pol = KVzapPolicy.from_manifest(read_manifest(bundle), decoding=decoding, layout="uniform", **policy)
    manager_cls = compression_manager_class()
    accept_in_llm_args()
    original = util.create_kv_cache_compression_manager

    def create(config, *args, **kwargs):
        if getattr(config, "algorithm", None) == ALGORITHM:
            return manager_cls(config, pol)
        return original(config, *args, **kwargs)

    util.create_kv_cache_compression_manager = create
    try:  # the RoPE gate of @43c2efcd; other versions have none (attach_scorer then checks each layer)
        compression = process.engine_module("tensorrt_llm._torch.kv_cache_compression")
    except MissingDependencyError:
        compression = None
    original_class = getattr(compression, "compression_manager_class", None)
    if original_class is not None:
        compression.compression_manager_class = (
            lambda algorithm: manager_cls if algorithm == ALGORITHM else original_class(algorithm))
    process.STATE["evicts"] = True
    return process.STATE["scorer"]
