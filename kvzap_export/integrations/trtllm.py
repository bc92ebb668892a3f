"""KVzap in TensorRT-LLM's PyTorch backend (``tensorrt_llm._torch``).

Targets (read from NVIDIA/TensorRT-LLM to learn names and interfaces; no code copied):

- **main after v1.2.1 (KV-cache compression framework, 1.3 release candidates)** — the full path:
  ``tensorrt_llm/_torch/pyexecutor/resource_manager.py`` (``BaseResourceManager``; the compression base
  ``KVCacheCompressionManager``, named ``BaseKVCacheCompressionManager`` in some snapshots, with hooks
  ``on_request_init`` / ``on_context_step_end`` / ``on_generation_step_begin`` /
  ``on_generation_step_end`` / ``on_request_finish`` and ``bind_kv_cache_managers``),
  ``tensorrt_llm/llmapi/llm_args.py`` (``KvCacheCompressionConfig``: ``changes_physical_kv_length``,
  ``supports_block_reuse()``), ``tensorrt_llm/_torch/pyexecutor/_util.py``
  (``create_kv_cache_compression_manager``, an if-chain on ``algorithm``),
  ``tensorrt_llm/_torch/kv_cache_compression/triattention/triattention.py`` (first user:
  ``LlmRequest.py_num_compressed_tokens``, KV pools read with ``get_buffers(layer, kv_layout="HND")``
  as ``[pages, kv_factor, kv_heads, tokens_per_block, head_dim]``, pages from
  ``get_batch_cache_indices``), ``tensorrt_llm/_torch/pyexecutor/kv_cache/kv_cache_manager_v2.py``.
- **v1.2.1 (sparse attention framework, prototype)** — context-phase compaction only:
  ``tensorrt_llm/_torch/attention_backend/trtllm.py`` (``TrtllmAttention``, ``TrtllmAttentionMetadata``),
  ``tensorrt_llm/_torch/attention_backend/sparse/rocket.py`` (``sparse_kv_predict(q, k, metadata,
  **kwargs)`` returning ``(int32 [num_kv_heads, total_selected], int32 [num_contexts + 1])``, and the
  metadata's ``kv_cache_params.num_cached_tokens_per_seq`` shortened for generation requests),
  ``tensorrt_llm/_torch/attention_backend/sparse/utils.py`` (``get_trtllm_sparse_attn_attention_backend``).
- Both: ``tensorrt_llm/_torch/modules/attention.py`` (``Attention.forward(position_ids, hidden_states,
  attn_metadata, ...)``: ``hidden_states`` never reaches the backend, so KVzap scores it in a pre-hook
  into a per-layer side buffer) and ``tensorrt_llm/_torch/models/modeling_utils.py``
  (``register_auto_model``).

TensorRT-LLM cannot be installed on the machines that built this (NVIDIA's index only; it needs a GPU),
so the glue is thin and the decisions live in ``core`` (tested against kvpress). The engine-free parts
here (``KVzapScorer``, ``attach_scorer``, ``KVzapCompression``, ``move_paged_kv``,
``context_sparse_kv``) are tested on the CPU with stand-in objects; the classes deriving from
TensorRT-LLM's are built on demand and raise ``MissingDependencyError`` without it.

Registering KVzap for your model (compression framework, main):

    from kvzap_export.integrations import trtllm as kvzap_trtllm
    kvzap_trtllm.install("bundle/")              # patches the manager factory for algorithm "kvzap"
    llm = LLM(model=..., kv_cache_config=KvCacheConfig(enable_block_reuse=False),   # KV cache manager V2
              kv_cache_compression_config=kvzap_trtllm.compression_config(), cuda_graph_config=None)
    kvzap_trtllm.attach_scorer(<the model's torch module>, kvzap_trtllm.scorer())   # or use kvzap_attention()

A custom model registered with ``@register_auto_model("MyArch")`` either builds its layers' attention
from ``kvzap_attention(Attention)`` (a subclass whose forward records the scores), or calls
``attach_scorer(model, scorer())`` after construction. Import the model's module before ``LLM(...)``.
See docs/integrations.md for the 1.2.x variant and the flags.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvzap_export.errors import ConfigError, InputError
from kvzap_export.integrations._lazy import import_engine
from kvzap_export.integrations.core import (
    BundleScorer, KVzapPolicy, RequestState, StepScores, budget_selection, context_budget, sparse_layout,
)

TRTLLM_SPARSE_VERSION = "1.2.1"
TRTLLM_COMPRESSION_TARGET = "main after v1.2.1 (KV-cache compression framework)"
INSTALL = ("TensorRT-LLM on a CUDA machine, from NVIDIA's index: pip install tensorrt-llm==1.2.1 "
           "(sparse_kv_predict variant) or a main-branch build (compression manager)")
ALGORITHM = "kvzap"


def _trtllm(module: str):
    return import_engine(module, "KVzap's TensorRT-LLM integration", INSTALL)


# ---- scoring (engine-free) -------------------------------------------------------------------------

class KVzapScorer:
    """The bundle's surrogate plus the per-layer side buffer of the current forward's scores."""

    def __init__(self, scorer: BundleScorer):
        self.scorer = scorer
        self.buffer = StepScores(scorer.num_layers)

    @classmethod
    def from_bundle(cls, bundle, tp_size: int = 1, tp_rank: int = 0) -> "KVzapScorer":
        return cls(BundleScorer.from_bundle(bundle, tp_size, tp_rank))

    def record(self, layer: int, hidden_states: torch.Tensor) -> None:
        """hidden_states: [num_tokens, hidden] (the forward's packed tokens: context chunks, then generation)."""
        self.buffer.write(layer, self.scorer.score(layer, hidden_states.reshape(-1, hidden_states.shape[-1])))


def attach_scorer(modules, scorer: KVzapScorer) -> list:
    """Forward pre-hooks recording each attention layer's ``hidden_states``; returns the hook handles.

    modules: a model (every submodule with an integer ``layer_idx`` and a forward taking
    ``(position_ids, hidden_states, attn_metadata, ...)``, i.e. TensorRT-LLM's ``Attention``), or an
    iterable of ``(layer_idx, module)``.
    """
    if isinstance(modules, torch.nn.Module):
        modules = [(m.layer_idx, m) for m in _attention_modules(modules)]
    handles = []
    for layer, module in modules:
        def hook(mod, args, kwargs, layer=layer):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[1]
            scorer.record(layer, hidden)

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    if not handles:
        raise ConfigError("no attention module found to score; pass (layer_idx, module) pairs explicitly")
    return handles


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    attention = _trtllm("tensorrt_llm._torch.modules.attention").Attention
    return [m for m in model.modules() if isinstance(m, attention) and isinstance(getattr(m, "layer_idx", None), int)]


def kvzap_attention(base: type, scorer_fn=None) -> type:
    """A subclass of TensorRT-LLM's ``Attention`` (``base``) that records KVzap scores before attending.

    For models written for TensorRT-LLM: build the layers' attention from the returned class.
    ``scorer_fn()`` returns the process's ``KVzapScorer`` (default: the one ``install`` created).
    """
    get = scorer_fn or scorer

    class KVzapAttention(base):
        def forward(self, position_ids, hidden_states, attn_metadata, *args, **kwargs):
            get().record(self.layer_idx, hidden_states)
            return super().forward(position_ids, hidden_states, attn_metadata, *args, **kwargs)

    KVzapAttention.__name__ = KVzapAttention.__qualname__ = f"KVzap{base.__name__}"
    return KVzapAttention


# ---- physical moves (engine-free) --------------------------------------------------------------------

def move_paged_kv(pool: torch.Tensor, pages: torch.Tensor, indices: torch.Tensor) -> None:
    """Moves one layer's kept K/V of one request to the front of its pages, per head, in place.

    pool: [num_pages, kv_factor, kv_heads, tokens_per_block, head_dim] (TensorRT-LLM's HND pool view);
    pages: int [n] the request's page ids in order; indices: int [kv_heads, K] physical source tokens
    (``Decision.indices[layer]``). Afterwards token ``j`` of head ``h`` holds old token ``indices[h, j]``.
    """
    tpb = pool.shape[3]
    pages = pages.to(device=pool.device, dtype=torch.int64)
    src = indices.to(device=pool.device, dtype=torch.int64)
    H, K = src.shape
    heads = torch.arange(H, device=pool.device)[:, None]
    dst = torch.arange(K, device=pool.device)[None, :].expand(H, K)
    values = pool[pages[src // tpb], :, heads, src % tpb, :]  # [H, K, kv_factor, head_dim]: a copy
    pool[pages[dst // tpb], :, heads, dst % tpb, :] = values


# ---- compression manager logic (engine-free) ---------------------------------------------------------

class KVzapCompression:
    """Step-end decisions and moves for the compression framework, independent of TensorRT-LLM classes.

    ``step_end(context, last_chunk, generation)`` reads the forward's scores from the side buffer, splits
    them per request (context chunk tokens first, in scheduled order, then one token per generation
    request), runs each request's ``RequestState`` and applies the uniform decision with ``mover``:
    ``mover(request, decision)`` moves K/V (every layer) and releases the tail; afterwards
    ``request.py_num_compressed_tokens = logical - physical`` (positions stay logical). ``agree`` maps the
    local counts of the step's requests to the counts every rank uses (all_reduce MAX), or None.
    Context chunks before the last are appended without compaction (decisions equal a one-shot prefill).
    """

    def __init__(self, scorer: KVzapScorer, policy: KVzapPolicy, mover=None, agree=None):
        if policy.layout != "uniform":
            raise ConfigError("TensorRT-LLM keeps one KV length per request: use the uniform layout")
        self.scorer, self.policy, self.mover, self.agree = scorer, policy, mover, agree
        self.states: dict[int, RequestState] = {}

    def request_init(self, request) -> None:
        s = self.scorer.scorer
        self.states[request.py_request_id] = RequestState(self.policy, s.num_layers, s.num_kv_heads)

    def request_finish(self, request) -> None:
        self.states.pop(request.py_request_id, None)

    def step_end(self, context: Iterable, last_chunk: Iterable, generation: Iterable) -> dict[int, object]:
        context, generation = list(context), list(generation)
        if not context and not generation:
            return {}
        finishing = {r.py_request_id for r in last_chunk}
        layers = self.scorer.buffer.take()
        sizes = [int(r.context_chunk_size) for r in context] + [1] * len(generation)
        if sum(sizes) > layers[0].shape[0]:
            raise InputError(f"the step fed {layers[0].shape[0]} scored tokens, the schedule implies {sum(sizes)}")
        pending, start = [], 0
        for i, (request, n) in enumerate(zip(context + generation, sizes)):
            scores = torch.stack([layer[start: start + n].T for layer in layers])  # [L, H, n]
            start += n
            state = self.states.get(request.py_request_id)
            if state is None:
                self.request_init(request)
                state = self.states[request.py_request_id]
            is_context = i < len(context)
            if is_context and request.py_request_id not in finishing:
                state.append(scores)
                continue
            pending.append((request, state, state.feed(scores, prefill=is_context, last=True)))
        counts = [p[2].local_count for p in pending]
        if self.agree is not None and pending:
            counts = list(self.agree(counts))
        decisions = {}
        for (request, state, proposal), count in zip(pending, counts):
            decision = state.commit(proposal, count)
            if decision.freed and self.mover is not None:
                self.mover(request, decision)
            request.py_num_compressed_tokens = state.num_compressed_tokens
            decisions[request.py_request_id] = decision
        return decisions


# ---- 1.2.x sparse_kv_predict (engine-free) -------------------------------------------------------------

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


# ---- engine-bound pieces ---------------------------------------------------------------------------------

_STATE: dict = {}


def scorer() -> KVzapScorer:
    """The process's scorer (created by ``install`` / ``install_sparse_kv``)."""
    if "scorer" not in _STATE:
        raise ConfigError("KVzap's TensorRT-LLM glue is not installed in this process; call install(bundle)")
    return _STATE["scorer"]


def _tp() -> tuple[int, int]:
    mapping = _STATE.get("mapping")
    return (mapping.tp_size, mapping.tp_rank) if mapping is not None else (1, 0)


def _world_max(counts: list[int]) -> list[int]:
    """Every rank (tensor and pipeline parallel) keeps the largest count: one KV length per request.

    The ranks schedule the same requests in the same order (no attention data parallelism), so the
    per-request lists line up; the communicator is the one TensorRT-LLM's resource manager uses.
    """
    utils = _trtllm("tensorrt_llm._utils")
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
    """``KvCacheCompressionConfig`` subclass for KVzap: physical length changes; no block reuse."""
    llm_args = _trtllm("tensorrt_llm.llmapi.llm_args")
    from typing import ClassVar

    class KVzapCompressionConfig(llm_args.KvCacheCompressionConfig):
        changes_physical_kv_length: ClassVar[bool] = True

        def supports_block_reuse(self) -> bool:
            return False  # compacted blocks no longer hold the token ids they were hashed under

    return KVzapCompressionConfig


def compression_config():
    return compression_config_class()(algorithm=ALGORITHM)


def compression_manager_class() -> type:
    """The resource manager TensorRT-LLM drives: its hooks map onto ``KVzapCompression``."""
    rm = _trtllm("tensorrt_llm._torch.pyexecutor.resource_manager")
    base = getattr(rm, "KVCacheCompressionManager", None) or getattr(rm, "BaseKVCacheCompressionManager", None)
    if base is None:
        raise ConfigError("this TensorRT-LLM has no KV-cache compression framework (added after v1.2.1); "
                          "use the 1.2.x sparse_kv_predict variant: install_sparse_kv()")

    class KVzapCompressionManager(base):
        # Read by the attention module's RoPE gate (through kv_cache_compression.compression_manager_class):
        # a method that evicts physically needs RoPE from position_ids, not from the cached length.
        physically_evicts_cached_tokens = True

        def __init__(self, config, policy: KVzapPolicy):
            super().__init__(config)
            self.kvzap = KVzapCompression(scorer(), policy, mover=self._move, agree=_world_max if _STATE.get("world", 1) > 1 else None)

        def on_request_init(self, request, **kwargs):
            self.kvzap.request_init(request)

        def on_generation_step_end(self, scheduled_batch, **kwargs):
            self.kvzap.step_end(scheduled_batch.context_requests, scheduled_batch.context_requests_last_chunk,
                                scheduled_batch.generation_requests)

        def on_request_finish(self, request, **kwargs):
            self.kvzap.request_finish(request)

        def _move(self, request, decision) -> None:
            manager = self.kv_cache_manager
            rid = request.py_request_id
            for layer in range(decision.indices.shape[0]):
                pool = manager.get_buffers(layer, kv_layout="HND")
                pages = torch.tensor(manager.get_batch_cache_indices([rid], layer)[0], dtype=torch.int64)
                move_paged_kv(pool, pages, decision.indices[layer])
            # Release the tail pages; the compacted length is published through py_num_compressed_tokens.
            manager.kv_cache_map[rid].resize(decision.uniform_count)

    return KVzapCompressionManager


def install(bundle, mapping=None, decoding: bool = True, **policy) -> KVzapScorer:
    """Loads the bundle's surrogate and makes ``algorithm="kvzap"`` build KVzap's compression manager.

    mapping: TensorRT-LLM's ``Mapping`` of this rank (tensor-parallel head slice); None = one GPU.
    """
    from kvzap_export.bundle.manifest import read_manifest

    util = _trtllm("tensorrt_llm._torch.pyexecutor._util")
    _STATE["mapping"] = mapping
    _STATE["world"] = mapping.world_size if mapping is not None else 1
    tp_size, tp_rank = _tp()
    _STATE["scorer"] = KVzapScorer.from_bundle(bundle, tp_size, tp_rank)
    pol = KVzapPolicy.from_manifest(read_manifest(bundle), decoding=decoding, layout="uniform", **policy)
    manager_cls = compression_manager_class()
    original = util.create_kv_cache_compression_manager

    def create(config, *args, **kwargs):
        if getattr(config, "algorithm", None) == ALGORITHM:
            return manager_cls(config, pol)
        return original(config, *args, **kwargs)

    util.create_kv_cache_compression_manager = create
    # The class-level lookup the attention RoPE gate uses: unknown algorithms map to None (RoPE stays fused).
    compression = _trtllm("tensorrt_llm._torch.kv_cache_compression")
    original_class = compression.compression_manager_class
    compression.compression_manager_class = lambda algorithm: manager_cls if algorithm == ALGORITHM else original_class(algorithm)
    return _STATE["scorer"]


def sparse_attention_class(keep_fraction: float, policy: KVzapPolicy) -> type:
    """1.2.x: ``TrtllmAttention`` whose ``sparse_kv_predict`` returns KVzap's context selection.

    Limits: context phase only (no eviction during generation); whole prompts (chunked prefill off,
    block reuse off); a fixed budget per request, ``context_budget(T, keep_fraction)``, because the
    kept count must be known from the prompt length alone when the metadata shortens
    ``num_cached_tokens_per_seq`` (a head whose kvpress set exceeds the budget loses its lowest-scored
    entries); pages past the budget stay allocated until the request ends (the stock KV cache manager
    does not rewind them).
    """
    trtllm = _trtllm("tensorrt_llm._torch.attention_backend.trtllm")

    class KVzapTrtllmAttentionMetadata(trtllm.TrtllmAttentionMetadata):
        def prepare(self):
            # Generation requests attend to the budget, not the prompt (positions stay logical).
            if self.kv_cache_manager is not None:
                for i in range(self.num_contexts, self.num_contexts + self.num_generations):
                    prompt = int(self.prompt_lens[i])
                    budget = context_budget(prompt, keep_fraction, policy.window, policy.sink)
                    self.kv_cache_params.num_cached_tokens_per_seq[i] += budget - prompt
            super().prepare()

    class KVzapTrtllmAttention(trtllm.TrtllmAttention):
        Metadata = KVzapTrtllmAttentionMetadata

        def sparse_kv_predict(self, q, k, metadata, *args, **kwargs):
            n = metadata.num_contexts
            if n == 0:
                return None, None
            seq_lens = [int(x) for x in metadata.seq_lens[:n]]
            layer_scores = scorer().buffer.layers[self.layer_idx]
            return context_sparse_kv(layer_scores[: sum(seq_lens)], seq_lens, policy, keep_fraction)

        def sparse_attn_predict(self, q, k, metadata, *args, **kwargs):
            return None, None

    return KVzapTrtllmAttention


def install_sparse_kv(bundle, keep_fraction: float, mapping=None, **policy) -> type:
    """1.2.x: routes ``sparse_attention_config`` algorithm "rocket"'s slot to KVzap's attention class.

    There is no registry in 1.2.x: this patches ``get_trtllm_sparse_attn_attention_backend`` and
    ``get_sparse_attn_kv_cache_manager`` (``sparse/utils.py``) so that a sparse attention config (the
    RocketKV one, ``RocketSparseAttentionConfig``, used only as the switch that enables the sparse path)
    selects ``KVzapTrtllmAttention`` and the stock ``KVCacheManager``. Returns the class.
    """
    from kvzap_export.bundle.manifest import read_manifest

    sparse_utils = _trtllm("tensorrt_llm._torch.attention_backend.sparse.utils")
    _STATE["mapping"] = mapping
    tp_size, tp_rank = _tp()
    _STATE["scorer"] = KVzapScorer.from_bundle(bundle, tp_size, tp_rank)
    pol = KVzapPolicy.from_manifest(read_manifest(bundle), decoding=False, layout="uniform", **policy)
    cls = sparse_attention_class(keep_fraction, pol)
    stock_manager = _trtllm("tensorrt_llm._torch.pyexecutor.resource_manager").KVCacheManager
    sparse_utils.get_trtllm_sparse_attn_attention_backend = lambda config: cls
    # The RocketKV config only switches the sparse path on: keep the stock KV cache manager (no KT cache).
    sparse_utils.get_sparse_attn_kv_cache_manager = lambda config: stock_manager
    return cls
