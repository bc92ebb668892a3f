"""KVzap in SGLang 0.5.23 (``sglang.srt``), through its plugin hook registry.

Two modes, one ``KVzapSGLang`` runtime per process (the scheduler process of each tensor-parallel rank
owns its model runner, so hooks, scheduler and attention backend share it):

``mode="evict"`` (memory is freed; uniform layout):
  1. scores: a BEFORE hook on ``LlamaAttention.forward`` / ``Qwen3Attention.forward`` (their
     ``hidden_states`` is the post-input-RMSNorm attention input) runs the bundle's surrogate and writes
     the new tokens' scores into a slot-indexed side buffer at ``forward_batch.out_cache_loc``;
  2. step end: a BEFORE hook on ``Scheduler.process_batch_result`` feeds each request's new scores to its
     ``core.RequestState``; tensor-parallel ranks agree on each request's count (all_reduce MAX over the
     TP CPU group); every layer's K/V of each head is moved into the first ``count`` slots of the
     request's ``req_to_token`` row (kept entries first; the row itself is not rewritten), the tail slots
     go back to the allocator (``free``), and ``seq_lens`` / ``kv_committed_len`` / ``kv_allocated_len``
     follow, so the row's first ``count`` slots are the request's whole cache;
  3. positions: an AFTER hook on ``ForwardBatch.init_new`` adds each request's evicted count to its
     positions, so RoPE continues from the logical length while attention reads the physical length.
  No compaction happens between prefill chunks (decisions equal a one-shot prefill anyway).

``mode="mask"`` (exact kvpress semantics, nothing freed; ragged layout):
  the same scoring and step-end decisions, no eviction; the attention backend ``kvzap_flex`` (registered
  with ``register_attention_backend``, a ``TorchFlexAttnBackend`` subclass) gives decode a per-layer,
  per-head ``mask_mod`` excluding each head's evicted entries (prefill stays dense, as kvpress).

Server flags (``sglang serve``): ``--disable-radix-cache`` (slots must belong to one request), CUDA graphs
off (``--cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled``: hooks run in Python;
the old ``--disable-cuda-graph`` is deprecated in 0.5.23), ``--disable-overlap-schedule`` (step end must not
race the next forward), ``--page-size 1``, no speculative decoding; mask mode adds ``--attention-backend
kvzap_flex`` and excludes ``--enable-mixed-chunk``. ``ServerSetup`` reads them at the first step end and a wrong one
stops the scheduler with one line naming the flag; CUDA-graph capture is refused in the scoring hook.
See docs/integrations.md.

Every SGLang name used here is listed once, in ``SGLANG_API``; tests/integrations/test_sglang_api.py
checks each against the real ``sglang==0.5.23`` source (downloaded, parsed with ``ast``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from kvzap_export.errors import ConfigError, KvzapError
from kvzap_export.integrations._lazy import import_engine
from kvzap_export.integrations.core import (
    UNQUANTIZED_DTYPES, BundleScorer, KVzapPolicy, RequestState, SlotScores, check_hidden_states,
)

log = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
INSTALL = f"pip install sglang=={SGLANG_VERSION} (on a CUDA machine); KVzap's SGLang glue targets that version"
BACKEND_NAME = "kvzap_flex"
MODES = ("evict", "mask")


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

SGLANG_API: tuple[ApiName, ...] = (
    # plugin hooks
    ApiName("sglang.srt.plugins.hook_registry", "HookRegistry.register", "method", ("cls", "target", "hook", "hook_type")),
    ApiName("sglang.srt.plugins.hook_registry", "HookType.BEFORE", "field"),
    ApiName("sglang.srt.plugins.hook_registry", "HookType.AFTER", "field"),
    # scoring: the attention modules whose forward receives the post-norm hidden states
    ApiName("sglang.srt.models.llama", "LlamaAttention.forward", "method", ("self", "positions", "hidden_states", "forward_batch")),
    ApiName("sglang.srt.models.llama", "LlamaAttention.attn", "field"),
    ApiName("sglang.srt.models.qwen3", "Qwen3Attention.forward", "method", ("self", "positions", "hidden_states", "forward_batch")),
    ApiName("sglang.srt.models.qwen3", "Qwen3Attention.attn", "field"),
    ApiName("sglang.srt.layers.radix_attention", "RadixAttention.layer_id", "field"),
    ApiName("sglang.srt.layers.radix_attention", "RadixAttention.tp_q_head_num", "field"),
    ApiName("sglang.srt.layers.radix_attention", "RadixAttention.tp_k_head_num", "field"),
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
    # step end
    ApiName("sglang.srt.managers.scheduler", "Scheduler.process_batch_result", "method", ("self", "batch", "result")),
    ApiName("sglang.srt.managers.scheduler", "Scheduler.chunked_req", "field"),
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
    ApiName(_SB, "Req.finished", "method", ("self",)),
    ApiName(_SB, "Req.beam_group", "field"),
    ApiName(_SB, "Req.session", "field"),
    ApiName("sglang.srt.session.session_controller", "Session.streaming", "field"),
    ApiName(_SB, "ReqKvInfo.req_pool_idx", "field"),
    ApiName(_SB, "ReqKvInfo.kv_committed_len", "field"),
    ApiName(_SB, "ReqKvInfo.kv_allocated_len", "field"),
    # memory pools
    ApiName("sglang.srt.mem_cache.memory_pool", "ReqToTokenPool.req_to_token", "field"),
    ApiName("sglang.srt.mem_cache.memory_pool", "MHATokenToKVPool.get_key_buffer", "method", ("self", "layer_id")),
    ApiName("sglang.srt.mem_cache.memory_pool", "MHATokenToKVPool.get_value_buffer", "method", ("self", "layer_id")),
    ApiName("sglang.srt.mem_cache.allocator.base", "BaseTokenToKVPoolAllocator.free", "method", ("self", "free_index")),
    ApiName("sglang.srt.mem_cache.allocator.base", "BaseTokenToKVPoolAllocator.get_kvcache", "method", ("self",)),
    ApiName("sglang.srt.mem_cache.memory_pool", "KVCache.size", "field"),
    ApiName("sglang.srt.mem_cache.memory_pool", "KVCache.page_size", "field"),
    ApiName("sglang.srt.mem_cache.memory_pool", "KVCache.dtype", "field"),
    ApiName("sglang.srt.mem_cache.memory_pool", "MHATokenToKVPool.is_quantized_kv_cache", "property"),
    # server setup checked at the first step end (ServerSetup)
    ApiName("sglang.srt.managers.scheduler", "Scheduler.tree_cache", "field"),
    ApiName("sglang.srt.managers.scheduler", "Scheduler.enable_overlap", "field"),
    ApiName("sglang.srt.managers.scheduler", "Scheduler.page_size", "field"),
    ApiName("sglang.srt.managers.scheduler", "Scheduler.spec_algorithm", "field"),
    ApiName("sglang.srt.managers.scheduler", "Scheduler.is_mixed_chunk", "field"),
    ApiName("sglang.srt.managers.scheduler", "Scheduler.token_to_kv_pool_allocator", "field"),
    ApiName("sglang.srt.mem_cache.unified_radix_cache", "UnifiedRadixCache.disable", "field"),
    ApiName("sglang.srt.speculative.spec_info", "SpeculativeAlgorithm.is_none", "method", ("self",)),
    ApiName("sglang.srt.runtime_context", "get_memory", "function", ()),
    ApiName("sglang.srt.runtime_context", "get_parallel", "function", ()),
    ApiName("sglang.srt.runtime_context", "get_disagg", "function", ()),
    ApiName("sglang.srt.arg_groups.fields.memory", "Memory.enable_unified_memory", "field"),
    ApiName("sglang.srt.arg_groups.fields.parallel", "Parallel.dcp_size", "field"),
    ApiName("sglang.srt.arg_groups.fields.parallel", "Parallel.pp_size", "field"),
    ApiName("sglang.srt.arg_groups.fields.parallel", "Parallel.attn_dp_size", "field"),
    ApiName("sglang.srt.arg_groups.fields.disagg", "Disagg.disaggregation_mode", "field"),
    # tensor parallelism
    ApiName("sglang.srt.distributed.parallel_state", "get_tp_group", "function", ()),
    ApiName("sglang.srt.distributed.parallel_state", "GroupCoordinator.cpu_group", "field"),
    ApiName("sglang.srt.distributed.parallel_state", "GroupCoordinator.world_size", "field"),
    ApiName("sglang.srt.distributed.parallel_state", "GroupCoordinator.rank_in_group", "field"),
    # masking backend
    ApiName("sglang.srt.layers.attention.attention_registry", "register_attention_backend", "function", ("name",)),
    ApiName("sglang.srt.arg_groups.choices", "add_attention_backend_choices", "name"),
    ApiName(_FLEX, "TorchFlexAttnBackend", "class"),
    ApiName(_FLEX, "TorchFlexAttnBackend.__init__", "method", ("self", "model_runner")),
    ApiName(_FLEX, "TorchFlexAttnBackend.forward_decode", "method", ("self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache")),
    ApiName(_FLEX, "TorchFlexAttnBackend.decode_block_masks", "field"),
    ApiName(_FLEX, "TorchFlexAttnBackend.device", "field"),
)

_API = {api.qualname: api for api in SGLANG_API}
# The attention classes whose forward the scoring hook wraps (add yours: same (positions, hidden_states,
# forward_batch) signature and an ``attn`` RadixAttention).
SCORED_ATTENTION = ("LlamaAttention.forward", "Qwen3Attention.forward")


def api(qualname: str) -> ApiName:
    return _API[qualname]


def _sglang(module: str):
    return import_engine(module, "KVzap's SGLang integration", INSTALL)


# ---- engine-free pieces (tested on the CPU with stand-in objects) --------------------------------------

def move_request_kv(buffers: list[tuple[torch.Tensor, torch.Tensor]], row: torch.Tensor, indices: torch.Tensor) -> None:
    """Moves each head's kept K/V to the front of the request's own slots, every layer.

    buffers: per layer (k_buffer, v_buffer), each [num_slots, kv_heads, head_dim] (SGLang's layout);
    row: int [physical_len] the request's slot ids (``req_to_token`` row); indices: int [L, H, K] physical
    sources per layer and head (``Decision.indices``). Afterwards slot ``row[j]`` of head ``h`` holds what
    slot ``row[indices[l, h, j]]`` held.
    """
    row = row.to(torch.int64)
    L, H, K = indices.shape
    heads = torch.arange(H, device=row.device)[:, None]
    dest = row[:K][None, :].expand(H, K)
    for layer, (k_buf, v_buf) in enumerate(buffers):
        src = row[indices[layer].to(row.device)]  # [H, K] slot ids
        for buf in (k_buf, v_buf):
            buf[dest, heads] = buf[src, heads]  # the gather copies before the scatter writes


def visibility_mask_mod(visible: torch.Tensor, group: int):
    """flex-attention ``mask_mod(b, h, q_idx, kv_idx)`` for one request and layer.

    visible: bool [kv_heads, kv_len]; ``h`` is the query head, ``h // group`` its KV head (GQA).
    """

    def mask_mod(b, h, q_idx, kv_idx):
        return visible[h // group, kv_idx]

    return mask_mod


def shared_kv_reason(req) -> str | None:
    """Why a request's KV slots are not its own, or None. KVzap leaves such a request alone: compacting it
    would corrupt the requests that read the same slots (beam search: every beam reads the prompt's slots;
    a streaming session: the next turn reuses this cache by its logical length)."""
    if getattr(req, "beam_group", None) is not None:
        return "beam search shares the prompt's KV slots between beams"
    session = getattr(req, "session", None)
    if session is not None and getattr(session, "streaming", False):
        return "a streaming session's next turn reuses this cache by its logical length"
    return None


@dataclass(frozen=True)
class ServerSetup:
    """The SGLang settings KVzap depends on, read from the scheduler at the first step end.

    ``problems(mode)`` lists each wrong one with the flag that fixes it: evict mode moves K/V inside a
    request's own slots and frees the tail, which is only sound when a slot belongs to one request (no
    radix cache), is freed one by one (page size 1), is addressed physically (no unified memory, no decode
    context parallelism), stores plain K/V (no quantized cache: its reads are dequantized copies and its
    scales would stay behind), and when the step end runs before the next batch is prepared (no overlap).
    Both modes need every layer in this process (no pipeline parallelism), ranks that schedule the same
    requests (no attention data parallelism) and a cache that stays on this server (no prefill/decode
    disaggregation, whose transfers read logical lengths).
    """

    radix_cache: bool
    overlap: bool
    page_size: int
    speculative: bool
    mixed_chunk: bool
    unified_memory: bool
    dcp_size: int
    pp_size: int
    attn_dp_size: int
    disaggregation: str
    kv_dtype: torch.dtype
    kv_quantized: bool
    kv_slots: int  # rows of every per-layer K/V buffer (pool size + padding page)

    @classmethod
    def of(cls, scheduler) -> "ServerSetup":
        context = _sglang("sglang.srt.runtime_context")
        parallel = context.get_parallel()
        kv = scheduler.token_to_kv_pool_allocator.get_kvcache()
        return cls(radix_cache=not getattr(scheduler.tree_cache, "disable", False), overlap=bool(scheduler.enable_overlap),
                   page_size=int(scheduler.page_size), speculative=not scheduler.spec_algorithm.is_none(),
                   mixed_chunk=bool(scheduler.is_mixed_chunk),
                   unified_memory=bool(context.get_memory().enable_unified_memory), dcp_size=int(parallel.dcp_size),
                   pp_size=int(parallel.pp_size), attn_dp_size=int(parallel.attn_dp_size),
                   disaggregation=str(context.get_disagg().disaggregation_mode), kv_dtype=kv.dtype,
                   kv_quantized=bool(getattr(kv, "is_quantized_kv_cache", False)), kv_slots=int(kv.size + kv.page_size))

    def problems(self, mode: str) -> list[str]:
        out = []
        if self.radix_cache:
            out.append("the radix cache is on (add --disable-radix-cache)")
        if self.overlap:
            out.append("the overlap scheduler is on (add --disable-overlap-schedule)")
        if self.speculative:
            out.append("speculative decoding is on (drop --speculative-algorithm)")
        if self.unified_memory:
            out.append("unified memory is on (drop --enable-unified-memory)")
        if self.dcp_size != 1:
            out.append(f"decode context parallelism is {self.dcp_size} (use --dcp-size 1)")
        if self.pp_size != 1:
            out.append(f"pipeline parallelism is {self.pp_size} (use --pp-size 1)")
        if self.attn_dp_size != 1:
            out.append(f"attention data parallelism is {self.attn_dp_size} (use --attn-dp-size 1)")
        if self.disaggregation != "null":
            out.append(f"prefill/decode disaggregation is on ({self.disaggregation}; drop --disaggregation-mode)")
        if mode == "mask" and self.mixed_chunk:
            out.append("mixed chunks run decode rows as dense extends, unmasked (drop --enable-mixed-chunk)")
        if mode == "evict":
            if self.page_size != 1:
                out.append(f"the page size is {self.page_size} (use --page-size 1: slots are freed one by one)")
            if self.kv_quantized or self.kv_dtype not in UNQUANTIZED_DTYPES:
                out.append(f"the KV cache is quantized ({self.kv_dtype}; use --kv-cache-dtype auto, or KVZAP_MODE=mask)")
        return out


class KVzapSGLang:
    """Per-process KVzap runtime: scorer, slot-indexed scores, one ``RequestState`` per request slot."""

    def __init__(self, scorer: BundleScorer, policy: KVzapPolicy, mode: str = "evict", tp_group=None):
        if mode not in MODES:
            raise ConfigError(f"mode {mode!r} is not supported; use one of {list(MODES)}")
        if mode == "evict" and policy.layout != "uniform":
            raise ConfigError("evict mode needs the uniform layout: SGLang slots are shared by all heads and layers")
        if mode == "mask" and policy.layout != "ragged":
            raise ConfigError("mask mode needs the ragged layout (each head's own set)")
        self.scorer, self.policy, self.mode, self.tp_group = scorer, policy, mode, tp_group
        self.slots = SlotScores(scorer.num_layers, scorer.num_kv_heads)
        self.states: dict[int, RequestState] = {}  # req_pool_idx -> state
        # req_pool_idx -> the Req on that row KVzap knows: tracked when the row has a state, else left alone
        self.owners: dict[int, object] = {}
        self.offsets: torch.Tensor | None = None  # int64 [max requests] evicted tokens per req_pool_idx
        self.setup: ServerSetup | None = None
        self._sized_for = None

    @classmethod
    def from_bundle(cls, bundle, mode: str = "evict", decoding: bool = True, tp_size: int = 1, tp_rank: int = 0,
                    tp_group=None, **policy) -> "KVzapSGLang":
        from kvzap_export.bundle.manifest import read_manifest

        layout = "uniform" if mode == "evict" else "ragged"
        pol = KVzapPolicy.from_manifest(read_manifest(bundle), decoding=decoding, layout=layout, **policy)
        return cls(BundleScorer.from_bundle(bundle, tp_size, tp_rank), pol, mode, tp_group)

    # scoring hook ------------------------------------------------------------------------------
    def score(self, layer: int, hidden_states: torch.Tensor, forward_batch) -> None:
        """Scores the forward's new tokens and writes them at their KV slots."""
        check_hidden_states(hidden_states, f"layer {layer}")
        if hidden_states.is_cuda and torch.cuda.is_current_stream_capturing():
            raise ConfigError("KVzap's hooks run in Python and cannot be captured in a CUDA graph; launch with "
                              "--cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled")
        slots = forward_batch.out_cache_loc
        if slots is None or slots.numel() == 0:
            return
        scores = self.scorer.score(layer, hidden_states.reshape(-1, hidden_states.shape[-1]))
        if self.setup is not None:  # sized once for the whole pool: no host sync
            self.slots.ensure(self.setup.kv_slots, scores.dtype, scores.device)
        elif self._sized_for is not forward_batch:  # before the first step end: one host sync per forward
            self.slots.ensure(int(slots.max()) + 1, scores.dtype, scores.device)
            self._sized_for = forward_batch
        self.slots.write(layer, slots, scores[: slots.shape[0]])

    # positions hook (evict mode) -------------------------------------------------------------------
    def shift_positions(self, forward_batch) -> None:
        """Logical RoPE positions: each request's evicted count is added to its tokens' positions."""
        self.forget_finished()  # a row freed since the last step end may already hold a new request
        if self.offsets is None or forward_batch.positions is None or forward_batch.req_pool_indices is None:
            return
        off = self.offsets.to(forward_batch.positions.device)[forward_batch.req_pool_indices.to(torch.int64)]
        if forward_batch.forward_mode.is_extend():
            if forward_batch.extend_seq_lens is None:
                return
            if forward_batch.extend_prefix_lens is not None:  # a new request reusing a slot row starts at 0
                off = torch.where(forward_batch.extend_prefix_lens.to(off.device) == 0, 0, off)
            off = torch.repeat_interleave(off, forward_batch.extend_seq_lens.to(off.device).to(torch.int64))
        if off.shape[0] != forward_batch.positions.shape[0]:
            return  # a layout this glue does not know (e.g. speculative verification): leave positions alone
        forward_batch.positions = forward_batch.positions + off.to(forward_batch.positions.dtype)

    # step end --------------------------------------------------------------------------------------
    def check_setup(self, setup: ServerSetup) -> None:
        """Refuses a server configured against KVzap (one line, every problem named); sizes the score buffer."""
        problems = setup.problems(self.mode)
        if problems:
            raise ConfigError(f"KVzap ({self.mode} mode) cannot run on this SGLang server: " + "; ".join(problems))
        self.setup = setup
        if self.slots.buffer is not None:
            self.slots.ensure(setup.kv_slots, self.slots.buffer.dtype, self.slots.buffer.device)

    def forget_finished(self) -> None:
        """Drops the state of requests that finished (or left their row) since the last step end."""
        for idx, req in list(self.owners.items()):
            if req.finished() or req.kv.req_pool_idx != idx:
                del self.owners[idx]
                self.states.pop(idx, None)
                if self.offsets is not None:
                    self.offsets[idx] = 0

    def _bypass(self, req, idx: int, reason: str) -> None:
        """Leaves a request alone (its cache is never compacted, its positions never shifted); says so once."""
        if self.owners.get(idx) is not req:
            log.warning("KVzap leaves request %r alone: %s", getattr(req, "rid", idx), reason)
            self.owners[idx] = req
        if self.offsets is not None and idx < self.offsets.shape[0]:
            self.offsets[idx] = 0

    def on_step_end(self, batch, chunked_req=None) -> None:
        """Feeds each request's new tokens to its state; evicts (evict mode) or updates masks (mask mode).

        Prefill or decode is decided per request (its state's phase), not per batch: with
        ``--enable-mixed-chunk`` an extend batch also carries one new token of each running request.
        """
        mode = batch.forward_mode
        extend, decode = mode.is_extend(), mode.is_decode()
        self.forget_finished()
        if not (extend or decode) or not batch.reqs:
            return
        if self.slots.buffer is None:
            raise ConfigError("no KVzap scores were recorded in this forward: the model's attention class is not hooked; "
                              f"add its forward to SCORED_ATTENTION (hooked now: {list(SCORED_ATTENTION)})")
        req_to_token = batch.req_to_token_pool.req_to_token
        pending = []
        for i, req in enumerate(batch.reqs):
            idx = req.kv.req_pool_idx
            if idx is None:
                continue
            seq_len = int(batch.seq_lens_cpu[i])
            n = int(batch.extend_lens[i]) if extend else 1
            if extend and int(batch.prefix_lens[i]) == 0:
                reason = shared_kv_reason(req)
                if reason is not None:
                    self._bypass(req, idx, reason)
                    continue
                self.states[idx] = RequestState(self.policy, self.scorer.num_layers, self.scorer.num_kv_heads,
                                                device=self.slots.buffer.device)
                self.owners[idx] = req
                self._set_offset(idx, 0, req_to_token.shape[0])
            state = self.states.get(idx)
            if state is None:
                if extend:  # e.g. a streaming session's next turn: its cache was left alone, so it stays alone
                    self._bypass(req, idx, f"it extends a cache KVzap did not build (prefix {int(batch.prefix_lens[i])})")
                continue
            row = req_to_token[idx, :seq_len]
            scores = self.slots.read(row[seq_len - n:])
            prefill = state.phase == "prefill"
            if prefill and extend and req is chunked_req:
                state.append(scores)  # more prompt chunks follow: no decision yet
                continue
            pending.append((i, req, idx, row, state, state.feed(scores, prefill=prefill, last=True)))
        if not pending:
            return
        counts = [p[5].local_count for p in pending]
        if self.mode == "evict":
            counts = self._agree(counts)
        for (i, req, idx, row, state, proposal), count in zip(pending, counts):
            decision = state.commit(proposal, count if self.mode == "evict" else None)
            if self.mode == "evict" and decision.freed:
                self._evict(batch, i, req, idx, row, decision, state)

    def _agree(self, counts: list[int]) -> list[int]:
        """Tensor-parallel ranks hold different heads: every rank keeps the largest count of any rank."""
        group = self.tp_group
        if group is None or getattr(group, "world_size", 1) <= 1:
            return counts
        import torch.distributed as dist

        t = torch.tensor(counts, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.cpu_group)
        return t.tolist()

    def _set_offset(self, idx: int, value: int, capacity: int) -> None:
        if self.offsets is None or self.offsets.shape[0] < capacity:
            grown = torch.zeros(capacity, dtype=torch.int64)
            if self.offsets is not None:
                grown[: self.offsets.shape[0]] = self.offsets
            self.offsets = grown
        self.offsets[idx] = value

    def _evict(self, batch, i: int, req, idx: int, row: torch.Tensor, decision, state: RequestState) -> None:
        kv = batch.token_to_kv_pool_allocator.get_kvcache()
        layers = range(self.scorer.num_layers)
        move_request_kv([(kv.get_key_buffer(layer), kv.get_value_buffer(layer)) for layer in layers], row, decision.indices)
        keep = decision.uniform_count
        batch.token_to_kv_pool_allocator.free(row[keep:].clone())
        batch.seq_lens[i] = keep
        batch.seq_lens_cpu[i] = keep
        if batch.orig_seq_lens is not None:
            batch.orig_seq_lens[i] = keep
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        req.kv.kv_committed_len = keep
        req.kv.kv_allocated_len = keep
        self._set_offset(idx, state.logical_length - keep, batch.req_to_token_pool.req_to_token.shape[0])

    # mask mode -------------------------------------------------------------------------------------
    def visible(self, req_pool_idx: int, layer: int, kv_len: int) -> torch.Tensor:
        """bool [kv_heads, kv_len] for one request and layer; tokens the state has not seen are visible."""
        out = torch.ones(self.scorer.num_kv_heads, kv_len, dtype=torch.bool)
        state = self.states.get(req_pool_idx)
        if state is not None:
            seen = min(state.logical_length, kv_len)
            out[:, :seen] = state.visible(layer)[:, :seen].cpu()
        return out

    def decode_block_masks(self, layer, forward_batch, device) -> list:
        from torch.nn.attention.flex_attention import create_block_mask

        group = layer.tp_q_head_num // layer.tp_k_head_num
        masks = []
        for idx, kv_len in zip(forward_batch.req_pool_indices.tolist(), forward_batch.seq_lens.tolist()):
            visible = self.visible(idx, layer.layer_id, int(kv_len)).to(device)
            masks.append(create_block_mask(visibility_mask_mod(visible, group), None, layer.tp_q_head_num, 1, int(kv_len),
                                           device=device, _compile=False))
        return masks


# ---- engine-bound pieces ------------------------------------------------------------------------------

_CONFIG: dict | None = None
_RUNTIME: KVzapSGLang | None = None


def runtime() -> KVzapSGLang:
    """This process's runtime, built on first use: by then SGLang's tensor-parallel state exists."""
    global _RUNTIME
    if _RUNTIME is None:
        if _CONFIG is None:
            raise ConfigError("KVzap's SGLang runtime is not installed in this process; call install() (or load the plugin)")
        parallel = _sglang("sglang.srt.distributed.parallel_state")
        group = _tp_group(parallel)
        size, rank = (group.world_size, group.rank_in_group) if group is not None else (1, 0)
        cfg = _CONFIG
        _RUNTIME = KVzapSGLang.from_bundle(cfg["bundle"], cfg["mode"], cfg["decoding"], size, rank, group, **cfg["policy"])
    return _RUNTIME


def _tp_group(parallel):
    """The TP group when distributed state exists (scheduler processes); None in a plain process."""
    try:
        return parallel.get_tp_group()
    except (AssertionError, AttributeError, RuntimeError):
        return None


def flex_backend_class():
    """``TorchFlexAttnBackend`` whose decode masks each head's evicted entries (exact kvpress semantics)."""
    base = _sglang(_FLEX).TorchFlexAttnBackend

    class KVzapFlexAttnBackend(base):
        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            self.decode_block_masks = runtime().decode_block_masks(layer, forward_batch, self.device)
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)

    return KVzapFlexAttnBackend


def _score_hook(attention, *args, **kwargs):
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[1]
    forward_batch = kwargs["forward_batch"] if "forward_batch" in kwargs else args[2]
    rt = runtime()
    if attention.attn.tp_k_head_num != rt.scorer.num_kv_heads:
        raise ConfigError(f"layer {attention.attn.layer_id} holds {attention.attn.tp_k_head_num} KV heads on this rank, "
                          f"the surrogate slice has {rt.scorer.num_kv_heads}; is the bundle for this model?")
    rt.score(attention.attn.layer_id, hidden, forward_batch)


def _step_end_hook(scheduler, batch, *args, **kwargs):
    rt = runtime()
    if rt.setup is None:
        rt.check_setup(ServerSetup.of(scheduler))
    rt.on_step_end(batch, getattr(scheduler, "chunked_req", None))


def _positions_hook(result, *args, **kwargs):
    runtime().shift_positions(result)


def install(bundle, mode: str = "evict", decoding: bool = True, **policy) -> None:
    """Registers KVzap's hooks (and, in mask mode, the ``kvzap_flex`` backend) in this process.

    Call it from a ``sglang.srt.plugins`` entry point (see ``load_plugin``) so that every SGLang process
    runs it before the engine starts; ``HookRegistry.apply_hooks`` then patches the targets. The runtime
    (surrogate, buffers, TP slice) is built at the first hook call.
    """
    global _CONFIG, _RUNTIME
    from kvzap_export.bundle.manifest import read_manifest

    hooks = _sglang("sglang.srt.plugins.hook_registry")
    if mode not in MODES:
        raise ConfigError(f"mode {mode!r} is not supported; use one of {list(MODES)}")
    # The manifest and the policy are checked here, in the launching process, so that a wrong bundle or
    # threshold stops the launch; the surrogate itself is loaded by each scheduler process at first use.
    KVzapPolicy.from_manifest(read_manifest(bundle), decoding=decoding, **policy)
    _CONFIG, _RUNTIME = {"bundle": str(bundle), "mode": mode, "decoding": decoding, "policy": policy}, None
    register, kind = hooks.HookRegistry.register, hooks.HookType
    for name in SCORED_ATTENTION:
        register(api(name).target, _score_hook, kind.BEFORE)
    register(api("Scheduler.process_batch_result").target, _step_end_hook, kind.BEFORE)
    if mode == "evict":
        register(api("ForwardBatch.init_new").target, _positions_hook, kind.AFTER)
    else:
        registry = _sglang("sglang.srt.layers.attention.attention_registry")
        choices = _sglang("sglang.srt.arg_groups.choices")
        backend = flex_backend_class()
        registry.register_attention_backend(BACKEND_NAME)(lambda runner: backend(runner))
        choices.add_attention_backend_choices([BACKEND_NAME])


def load_plugin() -> None:
    """``sglang.srt.plugins`` entry point (declared by this package, so installing kvzap-export next to SGLang
    is enough): ``KVZAP_BUNDLE`` (a bundle directory; unset = KVzap off), ``KVZAP_MODE`` (evict|mask),
    ``KVZAP_DECODING`` (1|0).

    SGLang logs and ignores an exception raised by a plugin, which would leave a server running without
    the KVzap its operator asked for; a wrong setting therefore exits the process with one line instead.
    """
    bundle = os.environ.get("KVZAP_BUNDLE")
    if not bundle:
        log.info("kvzap-export's SGLang plugin: KVZAP_BUNDLE is not set, KVzap is off")
        return
    mode = os.environ.get("KVZAP_MODE", "evict")
    decoding = os.environ.get("KVZAP_DECODING", "1").strip().lower()
    try:
        if decoding not in ("1", "0", "true", "false"):
            raise ConfigError(f"KVZAP_DECODING={decoding!r}: use 1 (also evict while decoding) or 0 (prefill only)")
        install(bundle, mode, decoding in ("1", "true"))
    except KvzapError as exc:
        raise SystemExit(f"kvzap-export: {exc}") from None
    log.info("KVzap on: bundle %s, mode %s", bundle, mode)
