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
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import NamedTuple

import torch

from kvzap_export.errors import ConfigError, InputError, MissingDependencyError
from kvzap_export.integrations._lazy import import_engine
from kvzap_export.integrations.core import (
    BundleScorer, KVzapPolicy, RequestState, StepScores, budget_selection, check_hidden_states, context_budget,
    sparse_layout,
)

log = logging.getLogger(__name__)

TRTLLM_SPARSE_VERSION = "1.2.1"
TRTLLM_COMPRESSION_TARGET = "main after v1.2.1 (KV-cache compression framework)"
INSTALL = ("TensorRT-LLM on a CUDA machine, from NVIDIA's index: pip install tensorrt-llm==1.2.1 "
           "(sparse_kv_predict variant) or a main-branch build (compression manager)")
ALGORITHM = "kvzap"


def _trtllm(module: str):
    return import_engine(module, "KVzap's TensorRT-LLM integration", INSTALL)


# ---- scoring (engine-free) -------------------------------------------------------------------------

class ForwardLayout(NamedTuple):
    """How one forward packed its tokens, from TensorRT-LLM's ``AttentionMetadata``: per sequence, its
    request id (``request_ids``) and query tokens (``seq_lens``); the first ``num_contexts`` are context chunks.

    Read during the forward because the requests' own chunk sizes are not: the executor moves each context
    request to its next chunk (``context_chunk_size`` becomes 0) before the resource managers' update.
    """

    request_ids: tuple[int, ...]
    tokens: tuple[int, ...]
    num_contexts: int

    @classmethod
    def of(cls, attn_metadata) -> "ForwardLayout":
        ids, seq_lens = getattr(attn_metadata, "request_ids", None), getattr(attn_metadata, "seq_lens", None)
        if ids is None or seq_lens is None:
            raise ConfigError("the attention metadata carries no request_ids / seq_lens; KVzap needs them to split a "
                              "forward's scores per request (TensorRT-LLM's PyTorch backend sets both)")
        tokens = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
        return cls(tuple(int(i) for i in ids), tuple(int(n) for n in tokens), int(attn_metadata.num_contexts))

    def spans(self) -> dict[int, tuple[int, int]]:
        """request id -> (first token, tokens) in the forward's packed order."""
        out, start = {}, 0
        for rid, n in zip(self.request_ids, self.tokens):
            out[rid] = (start, n)
            start += n
        return out


class KVzapScorer:
    """The bundle's surrogate plus the per-layer side buffer of the current forward's scores and its layout."""

    def __init__(self, scorer: BundleScorer):
        self.scorer = scorer
        self.buffer = StepScores(scorer.num_layers)
        self.layout: ForwardLayout | None = None

    @classmethod
    def from_bundle(cls, bundle, tp_size: int = 1, tp_rank: int = 0) -> "KVzapScorer":
        return cls(BundleScorer.from_bundle(bundle, tp_size, tp_rank))

    def record(self, layer: int, hidden_states: torch.Tensor, attn_metadata=None) -> None:
        """hidden_states: [num_tokens, hidden], the forward's packed tokens; attn_metadata: the forward's
        ``AttentionMetadata`` (its layout is read once per forward)."""
        check_hidden_states(hidden_states, f"layer {layer}")
        if attn_metadata is not None:
            if getattr(attn_metadata, "is_cuda_graph", False):
                raise ConfigError("KVzap's hooks run in Python and a CUDA graph replay skips them; build the LLM with "
                                  "cuda_graph_config=None")
            if self.layout is None:
                self.layout = ForwardLayout.of(attn_metadata)
        self.buffer.write(layer, self.scorer.score(layer, hidden_states.reshape(-1, hidden_states.shape[-1])))

    def take(self) -> tuple[list[torch.Tensor], ForwardLayout | None]:
        """The forward's per-layer scores [num_tokens, H] and its layout; the buffer starts empty again."""
        layout, self.layout = self.layout, None
        return self.buffer.take(), layout


def attach_scorer(modules, scorer: KVzapScorer) -> list:
    """Forward pre-hooks recording each attention layer's ``hidden_states``; returns the hook handles.

    modules: a model (every submodule with an integer ``layer_idx`` and a forward taking
    ``(position_ids, hidden_states, attn_metadata, ...)``, i.e. TensorRT-LLM's ``Attention``), or an
    iterable of ``(layer_idx, module)``.
    """
    if isinstance(modules, torch.nn.Module):
        modules = [(m.layer_idx, m) for m in _attention_modules(modules)]
    modules = list(modules)
    for layer, module in modules:
        _refuse_fused_rope(layer, module)
    handles = []
    for layer, module in modules:
        def hook(mod, args, kwargs, layer=layer):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[1]
            metadata = kwargs["attn_metadata"] if "attn_metadata" in kwargs else args[2] if len(args) > 2 else None
            scorer.record(layer, hidden, metadata)

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    if not handles:
        raise ConfigError("no attention module found to score; pass (layer_idx, module) pairs explicitly")
    return handles


def _refuse_fused_rope(layer: int, module) -> None:
    """Physical eviction needs RoPE from ``position_ids``: a kernel that derives positions from the cached
    length would rotate every token after an eviction by the wrong angle."""
    if getattr(module, "rope_fusion", False) and _STATE.get("evicts", False):
        raise ConfigError(f"attention layer {layer} fuses RoPE into the attention kernel (rope_fusion=True); KVzap's "
                          "physical eviction needs RoPE applied from position_ids: call install() before building the "
                          "model, or build its attention with rope_fusion disabled")


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
            _refuse_fused_rope(self.layer_idx, self)
            get().record(self.layer_idx, hidden_states, attn_metadata)
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


def reserved_tail(manager) -> int:
    """Tokens a resize must keep past the kept entries: the manager's extra KV tokens (``num_extra_kv_tokens``
    of ``KVCacheManagerV2`` at af8c3bfa; 0 when absent). The overlap scheduler, which would also reserve the
    next step's slots, is refused (``KVzapCompressionManager``)."""
    return int(getattr(manager, "num_extra_kv_tokens", 0) or 0)


def cache_pages(manager, request_id: int, layer: int, tokens: int, tokens_per_block: int) -> torch.Tensor:
    """The request's page ids for one (global) layer, one per block of its capacity, in order.

    ``get_batch_cache_indices`` marks a block whose page was dropped (sliding-window layers) with -1, in place:
    the position of every later page depends on it. A -1 among the blocks holding the first ``tokens`` tokens
    is refused: KVzap moves entries across the whole sequence, which needs every page of full attention.
    """
    pages = torch.tensor([int(p) for p in manager.get_batch_cache_indices([request_id], layer)[0]], dtype=torch.int64)
    needed = -(-tokens // tokens_per_block)
    if needed > pages.numel() or bool((pages[:needed] < 0).any()):
        raise ConfigError(f"layer {layer} of request {request_id} has dropped or missing pages among its first {tokens} "
                          "tokens (a sliding-window layer?); KVzap supports full-attention layers only")
    return pages


def compaction_capacity(count: int, tail: int, history_length: int) -> int:
    """The capacity a request's cache can shrink to after keeping ``count`` entries.

    ``KVCacheManagerV2`` never lowers a cache's history length (the prompt, once its last chunk ran; generation
    steps pass no history while a compression manager owns it), and a capacity below it is an error. So the
    pages of evicted *prompt* entries stay allocated until the request ends; what eviction saves there is
    attention work and reads. Decoding past the prompt is where pages are given back.
    """
    return max(count + tail, history_length)


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


def check_pool(pool: torch.Tensor, kv_heads: int, layer: int) -> None:
    """A pool KVzap can move entries of: K/V in elements of their own (no packed NVFP4 bytes, whose block scales
    live elsewhere) and this rank's KV heads (``install(mapping=...)`` slices the surrogate the same way)."""
    if pool.dtype in (torch.int8, torch.uint8):
        raise ConfigError(f"layer {layer}: the KV cache is packed ({pool.dtype}, e.g. NVFP4) and its block scales would "
                          "stay behind; use an FP16/BF16/FP8 KV cache with KVzap")
    if pool.shape[2] != kv_heads:
        raise ConfigError(f"layer {layer}: the KV pool holds {pool.shape[2]} heads, KVzap's surrogate slice {kv_heads}; "
                          "pass this rank's mapping to install()")


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


def skip_request(request) -> bool:
    """Requests whose tokens are in the forward but which KVzap does not touch: TensorRT-LLM's dummy padding
    requests, and requests already complete (their cache is released next) — as TriAttention skips them."""
    if getattr(request, "is_dummy", False):
        return True
    state = getattr(request, "state", None)
    return getattr(state, "name", None) == "GENERATION_COMPLETE"


def clamp_prompt_lens(prompt_lens: list[int], num_contexts: int, budget_of) -> list[int]:
    """Generation requests' prompt lengths as the attention kernel must see them after context compaction:
    ``min(prompt, budget_of(prompt))``; context requests unchanged."""
    return [p if i < num_contexts else min(p, budget_of(p)) for i, p in enumerate(int(x) for x in prompt_lens)]


# ---- compression manager logic (engine-free) ---------------------------------------------------------

class KVzapCompression:
    """Step-end decisions and moves for the compression framework, independent of TensorRT-LLM classes.

    ``step_end(context, last_chunk, generation)`` reads the forward's scores from the side buffer, splits
    them per request by the forward's own layout (``ForwardLayout``: request ids and token counts from the
    attention metadata), runs each request's ``RequestState`` and applies the uniform decision with ``mover``:
    ``mover(request, decision)`` moves K/V (every layer) and releases the tail; afterwards
    ``request.py_num_compressed_tokens = logical - physical`` (positions stay logical). ``agree`` maps the
    local counts of the step's requests to the counts every rank uses (all_reduce MAX), or None.
    Context chunks before the last are appended without compaction (decisions equal a one-shot prefill).
    ``skip(request)``: the request's tokens are in the forward but it has no KVzap state (TensorRT-LLM's
    dummy padding requests, requests that finished this step); ``hold(request)``: decide, but keep every
    physical entry this step (the engine cannot move this request's K/V now, e.g. an inactive cache): the
    rule's set is still tracked. A generation request KVzap never saw a prompt of (its cache was built
    elsewhere) is left alone, with one warning.
    """

    def __init__(self, scorer: KVzapScorer, policy: KVzapPolicy, mover=None, agree=None, skip=None, hold=None):
        if policy.layout != "uniform":
            raise ConfigError("TensorRT-LLM keeps one KV length per request: use the uniform layout")
        self.scorer, self.policy, self.mover, self.agree = scorer, policy, mover, agree
        self.skip, self.hold = skip, hold
        self.states: dict[int, RequestState] = {}
        self.strangers: set[int] = set()  # generation requests without a KVzap state, told once

    def request_init(self, request) -> None:
        s = self.scorer.scorer
        self.states[request.py_request_id] = RequestState(self.policy, s.num_layers, s.num_kv_heads)

    def request_finish(self, request) -> None:
        self.states.pop(request.py_request_id, None)
        self.strangers.discard(request.py_request_id)

    def step_end(self, context: Iterable, last_chunk: Iterable, generation: Iterable) -> dict[int, object]:
        context, generation = list(context), list(generation)
        if not context and not generation:
            return {}
        finishing = {r.py_request_id for r in last_chunk}
        layers, layout = self.scorer.take()
        if layout is None:
            raise InputError("the forward's layout was not recorded: attach the scorer with attach_scorer() or "
                             "kvzap_attention(), whose hooks read the attention metadata")
        spans = layout.spans()
        if sum(layout.tokens) > layers[0].shape[0]:
            raise InputError(f"the step scored {layers[0].shape[0]} tokens, its attention metadata lists {sum(layout.tokens)}")
        pending = []
        for i, request in enumerate(context + generation):
            if self.skip is not None and self.skip(request):
                continue
            rid, is_context = request.py_request_id, i < len(context)
            if rid not in spans:
                raise InputError(f"request {rid} was scheduled but is not in the forward's attention metadata")
            start, n = spans[rid]
            if not is_context and n != 1:
                raise ConfigError(f"generation request {rid} fed {n} tokens in one step; KVzap handles one "
                                  "(speculative decoding is not supported)")
            state = self.states.get(rid)
            if state is None and not is_context:
                self._stranger(rid)
                continue
            if state is None:
                self.request_init(request)
                state = self.states[rid]
            scores = torch.stack([layer[start: start + n].T for layer in layers])  # [L, H, n]
            if is_context and rid not in finishing:
                state.append(scores)
                continue
            pending.append((request, state, state.feed(scores, prefill=is_context, last=True)))
        counts = [p[2].local_count for p in pending]
        if self.agree is not None and pending:
            counts = list(self.agree(counts))
        decisions = {}
        for (request, state, proposal), count in zip(pending, counts):
            if self.hold is not None and self.hold(request):
                count = int(state.counts[0, 0])  # every row holds the same length in the uniform layout
            decision = state.commit(proposal, count)
            if decision.freed and self.mover is not None:
                self.mover(request, decision)
            request.py_num_compressed_tokens = state.num_compressed_tokens
            decisions[request.py_request_id] = decision
        return decisions

    def _stranger(self, rid: int) -> None:
        if rid not in self.strangers:
            self.strangers.add(rid)
            log.warning("KVzap leaves request %s alone: its prompt was not scored here (a cache built "
                        "elsewhere, e.g. disaggregated serving)", rid)


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


def _check_mapping(mapping) -> None:
    """Every layer must be scored in this process, and every rank must schedule the same requests."""
    if mapping is None:
        return
    if getattr(mapping, "pp_size", 1) > 1:
        raise ConfigError(f"pipeline parallelism (pp_size={mapping.pp_size}) is not supported by KVzap's TensorRT-LLM "
                          "glue: each step's decision needs every layer's scores in one process")
    if getattr(mapping, "enable_attention_dp", False):
        raise ConfigError("attention data parallelism is not supported by KVzap's TensorRT-LLM glue: ranks must "
                          "schedule the same requests to agree on one count per request")


def _world_max(counts: list[int]) -> list[int]:
    """Every tensor-parallel rank keeps the largest count: one KV length per request.

    The ranks schedule the same requests in the same order (no attention data parallelism, checked by
    ``install``), so the per-request lists line up; the communicator is the one TensorRT-LLM's resource
    manager uses (``tensorrt_llm._utils.mpi_comm``, or torch.distributed when MPI is disabled).
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
    """``KvCacheCompressionConfig`` subclass for KVzap: physical length changes; no block reuse; no speculation."""
    if "config_class" in _STATE:
        return _STATE["config_class"]
    llm_args = _trtllm("tensorrt_llm.llmapi.llm_args")
    from typing import ClassVar, Literal

    class KVzapCompressionConfig(llm_args.KvCacheCompressionConfig):
        changes_physical_kv_length: ClassVar[bool] = True
        algorithm: Literal["kvzap"] = ALGORITHM

        def supports_block_reuse(self) -> bool:
            return False  # compacted blocks no longer hold the token ids they were hashed under

        def supports_speculative_decoding(self) -> bool:
            return False  # draft tokens' K/V and the reserved tail are not handled by the step-end moves

    _STATE["config_class"] = KVzapCompressionConfig
    return KVzapCompressionConfig


def compression_config():
    """The ``kv_cache_compression_config`` to pass to ``LLM(...)`` (``install`` must run first)."""
    return compression_config_class()(algorithm=ALGORITHM)


def _accept_in_llm_args() -> None:
    """``LLM(...)`` validates ``kv_cache_compression_config`` against a union of TensorRT-LLM's algorithms."""
    import inspect

    llm_args = _trtllm("tensorrt_llm.llmapi.llm_args")
    models = [obj for _, obj in inspect.getmembers(llm_args, inspect.isclass) if obj.__module__ == llm_args.__name__]
    if not accept_config(models, compression_config_class()) and not any(
            "kv_cache_compression_config" in getattr(m, "model_fields", {}) for m in models):
        raise ConfigError("this TensorRT-LLM's LLM arguments have no kv_cache_compression_config (the KV-cache "
                          "compression framework came after v1.2.1); use the 1.2.x variant: install_sparse_kv()")


def compression_manager_class() -> type:
    """The resource manager TensorRT-LLM drives (pinned API: ``KVCacheCompressionManager`` @ af8c3bfa)."""
    rm = _trtllm("tensorrt_llm._torch.pyexecutor.resource_manager")
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
            self.kvzap = KVzapCompression(scorer(), policy, mover=self._move,
                                          agree=_world_max if _STATE.get("world", 1) > 1 else None,
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

    util = _trtllm("tensorrt_llm._torch.pyexecutor._util")
    _check_mapping(mapping)
    _STATE["mapping"] = mapping
    _STATE["world"] = mapping.tp_size if mapping is not None else 1
    tp_size, tp_rank = _tp()
    _STATE["scorer"] = KVzapScorer.from_bundle(bundle, tp_size, tp_rank)
    pol = KVzapPolicy.from_manifest(read_manifest(bundle), decoding=decoding, layout="uniform", **policy)
    manager_cls = compression_manager_class()
    _accept_in_llm_args()
    original = util.create_kv_cache_compression_manager

    def create(config, *args, **kwargs):
        if getattr(config, "algorithm", None) == ALGORITHM:
            return manager_cls(config, pol)
        return original(config, *args, **kwargs)

    util.create_kv_cache_compression_manager = create
    try:  # the RoPE gate of @43c2efcd; other versions have none (attach_scorer then checks each layer)
        compression = _trtllm("tensorrt_llm._torch.kv_cache_compression")
    except MissingDependencyError:
        compression = None
    original_class = getattr(compression, "compression_manager_class", None)
    if original_class is not None:
        compression.compression_manager_class = (
            lambda algorithm: manager_cls if algorithm == ALGORITHM else original_class(algorithm))
    _STATE["evicts"] = True
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
            layer_scores = scorer().buffer.layers[self.layer_idx]
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

    _trtllm("tensorrt_llm._torch.attention_backend.sparse.utils")  # the engine first: one line without it
    _check_mapping(mapping)
    _STATE["mapping"] = mapping
    tp_size, tp_rank = _tp()
    _STATE["scorer"] = KVzapScorer.from_bundle(bundle, tp_size, tp_rank)
    pol = KVzapPolicy.from_manifest(read_manifest(bundle), decoding=False, layout="uniform", **policy)
    cls = sparse_attention_class(keep_fraction, pol)
    stock_manager = no_reuse_manager_class(_trtllm("tensorrt_llm._torch.pyexecutor.resource_manager").KVCacheManager)
    for module in ("tensorrt_llm._torch.attention_backend.sparse.utils", "tensorrt_llm._torch.attention_backend.utils"):
        target = _trtllm(module)
        if hasattr(target, "get_trtllm_sparse_attn_attention_backend"):
            target.get_trtllm_sparse_attn_attention_backend = lambda *args, **kwargs: cls
    # The RocketKV config only switches the sparse path on: the stock KV cache manager (no KT cache), with the
    # block-reuse refusal RocketKV's manager makes at construction.
    for module in ("tensorrt_llm._torch.attention_backend.sparse.utils", "tensorrt_llm._torch.pyexecutor._util"):
        target = _trtllm(module)
        if hasattr(target, "get_sparse_attn_kv_cache_manager"):
            target.get_sparse_attn_kv_cache_manager = lambda *args, **kwargs: stock_manager
    _STATE["evicts"] = False  # RoPE as for RocketKV: the metadata shortens the cached length and prompt lengths
    return cls
