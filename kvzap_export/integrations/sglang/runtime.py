"""Per-process KVzap runtime inside SGLang: scores by slot, one ``RequestState`` per request, step end.

One ``KVzapSGLang`` per scheduler process (each tensor-parallel rank owns its model runner, so the hooks,
the scheduler and the attention backend share it). Modes:

- ``evict`` (uniform layout, memory freed): at each step end every layer's K/V of each head is moved into
  the first ``count`` slots of the request's ``req_to_token`` row (kept entries first; the row itself is not
  rewritten), the tail slots go back to SGLang's allocator (``free``), and ``seq_lens`` /
  ``kv_committed_len`` / ``kv_allocated_len`` follow; positions are shifted by the evicted count
  (``shift_positions``) so RoPE continues from the logical length. The count is the largest any head of
  any layer keeps, so the other heads hold extras; the masking backends hide them (``visible``), so decode
  attends to exactly kvpress's set.
- ``mask`` (ragged layout, exact kvpress semantics, nothing freed): the same decisions, no eviction; the
  masking attention backends (``masking.py``) exclude each head's evicted entries during decode.

Each request may override the server's default through ``sampling_params.custom_params["kvzap"]``:
``"off"`` (left alone: a dense request on the same server), ``"prefill"`` (kvpress ``decoding=False``) or
``"decoding"`` (kvpress ``decoding=True``).
"""

from __future__ import annotations

import dataclasses
import logging
from http import HTTPStatus

import torch

from kvzap_export.errors import ConfigError, InputError
from kvzap_export.integrations.core import KVzapPolicy, RequestState
from kvzap_export.integrations.scoring import BundleScorer, SlotScores, check_hidden_states
from kvzap_export.integrations.host_reads import counted
from kvzap_export.integrations.sglang.api import sglang_module
from kvzap_export.integrations.sglang.server_setup import ServerSetup

log = logging.getLogger(__name__)

MODES = ("evict", "mask", "ragged")
REQUEST_KEY = "kvzap"  # sampling_params.custom_params[REQUEST_KEY]
REQUEST_CHOICES = ("off", "prefill", "decoding")


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


def request_choice(req, default: str) -> str:
    """The request's ``custom_params["kvzap"]`` (off | prefill | decoding), else ``default``."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    choice = params.get(REQUEST_KEY, default) if isinstance(params, dict) else default
    if choice not in REQUEST_CHOICES:
        raise InputError(f'custom_params["{REQUEST_KEY}"]={choice!r}: use one of {list(REQUEST_CHOICES)}')
    return choice


class KVzapSGLang:
    """Scorer, slot-indexed scores, one ``RequestState`` per request row, the step-end decisions."""

    def __init__(self, scorer: BundleScorer, policy: KVzapPolicy, mode: str = "evict", tp_group=None):
        if mode not in MODES:
            raise ConfigError(f"mode {mode!r} is not supported; use one of {list(MODES)}")
        if mode == "evict" and policy.layout != "uniform":
            raise ConfigError("evict mode needs the uniform layout: SGLang slots are shared by all heads and layers")
        if mode in ("mask", "ragged") and policy.layout != "ragged":
            raise ConfigError(f"{mode} mode needs the ragged layout (each head's own set)")
        self.scorer, self.policy, self.mode, self.tp_group = scorer, policy, mode, tp_group
        self.default_choice = "decoding" if policy.decoding else "prefill"
        self.slots = SlotScores(scorer.num_layers, scorer.num_kv_heads)
        self.states: dict[int, RequestState] = {}  # req_pool_idx -> state
        # req_pool_idx -> the Req on that row KVzap knows: tracked when the row has a state, else left alone
        self.owners: dict[int, object] = {}
        self.offsets: torch.Tensor | None = None  # int64 [max requests] evicted tokens per req_pool_idx
        self.setup: ServerSetup | None = None
        self.stats = None  # a stats.AllocatorReadings when KVZAP_STATS is set
        self._sized_for = None
        self._visible: dict[int, torch.Tensor] = {}  # row -> the masks its last decision left (batch_visibility)

    @classmethod
    def from_bundle(cls, bundle, mode: str = "evict", decoding: bool = True, tp_size: int = 1, tp_rank: int = 0,
                    tp_group=None, **policy) -> "KVzapSGLang":
        from kvzap_export.bundle.manifest import read_manifest

        layout = "uniform" if mode == "evict" else "ragged"
        pol = KVzapPolicy.from_manifest(read_manifest(bundle), decoding=decoding, layout=layout, **policy)
        return cls(BundleScorer.from_bundle(bundle, tp_size, tp_rank), pol, mode, tp_group)

    # scoring hook ------------------------------------------------------------------------------
    @counted("forward")
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
        elif self._sized_for is not forward_batch:  # before the setup is known: one host sync per forward
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

    # setup -----------------------------------------------------------------------------------------
    def check_setup(self, setup: ServerSetup, decode_backends: tuple[str, ...] = (),
                    prefill_backends: tuple[str, ...] = ()) -> None:
        """Refuses a server configured against KVzap (one line, every problem named); sizes the score buffer."""
        problems = setup.problems(self.mode, decode_backends, prefill_backends)
        if problems:
            raise ConfigError(f"KVzap ({self.mode} mode) cannot run on this SGLang server: " + "; ".join(problems))
        self.setup = setup
        if self.slots.buffer is not None:
            self.slots.ensure(setup.kv_slots, self.slots.buffer.dtype, self.slots.buffer.device)

    # step end --------------------------------------------------------------------------------------
    def forget_finished(self) -> None:
        """Drops the state of requests that finished (or left their row) since the last step end."""
        for idx, req in list(self.owners.items()):
            if req.finished() or req.kv.req_pool_idx != idx:
                del self.owners[idx]
                self.states.pop(idx, None)
                self._visible.pop(idx, None)
                if self.offsets is not None:
                    self.offsets[idx] = 0
                self.release(idx)

    def release(self, idx: int) -> None:
        """A request left row ``idx`` (subclasses give its per-head storage back)."""

    def pool_readings(self, idx: int | None) -> dict:
        """What a per-head pool holds (``idx`` None) or holds for row ``idx`` (``stats.py``); SGLang's own pool
        has no per-head view."""
        return {}

    def extra_bytes(self) -> dict:
        """Bytes of the buffers KVzap adds to SGLang's (mask and evict modes: the slot-indexed score buffer)."""
        buffer = self.slots.buffer
        return {"score_buffer": buffer.numel() * buffer.element_size() if buffer is not None else 0}

    def decided(self, idx: int) -> dict:
        """What KVzap's decisions imply for row ``idx`` ({} when KVzap leaves it alone): its logical length, the
        entries its state keeps, the entries kvpress's rule keeps (``stats.py``)."""
        state = self.states.get(idx)
        if state is None:
            return {}
        return {"decoding": bool(state.policy.decoding), "logical_length": state.logical_length,
                "decided_entries": int(state.counts.sum()), "decided_rule_entries": int(state.rule_kept.sum())}

    def _bypass(self, req, idx: int, reason: str, warn: bool = True) -> None:
        """Leaves a request alone (its cache is never compacted, its positions never shifted); says so once."""
        if self.owners.get(idx) is not req:
            if warn:
                log.warning("KVzap leaves request %r alone: %s", getattr(req, "rid", idx), reason)
            self.owners[idx] = req
        self.states.pop(idx, None)
        if self.offsets is not None and idx < self.offsets.shape[0]:
            self.offsets[idx] = 0

    def _choose(self, req, idx: int) -> str | None:
        """A new request on row ``idx``: its setting (``prefill`` or ``decoding``), or None when it is left alone.

        A request whose ``custom_params["kvzap"]`` is not understood is aborted with a 400 (its own error),
        never raised here: an exception in the step end would stop the whole scheduler.
        """
        reason = shared_kv_reason(req)
        try:
            choice = request_choice(req, self.default_choice)
        except InputError as exc:
            abort = sglang_module("sglang.srt.managers.schedule_batch").FINISH_ABORT
            req.to_finish = abort(f"KVzap: {exc}", HTTPStatus.BAD_REQUEST, "BadRequestError")
            self._bypass(req, idx, str(exc))
            return None
        if reason is None and choice == "off":
            reason = f'it asked for custom_params["{REQUEST_KEY}"]="off"'
        if reason is not None:
            self._bypass(req, idx, reason, warn=choice != "off")
            return None
        self.owners[idx] = req
        return choice

    def _start(self, req, idx: int, capacity: int) -> RequestState | None:
        """A new request on row ``idx``: its state, or None when it is left alone (``_choose``)."""
        choice = self._choose(req, idx)
        if choice is None:
            return None
        policy = self.policy if (choice == "decoding") == self.policy.decoding else dataclasses.replace(
            self.policy, decoding=choice == "decoding")
        state = self.states[idx] = RequestState(policy, self.scorer.num_layers, self.scorer.num_kv_heads,
                                                device=self.slots.buffer.device)
        self._set_offset(idx, 0, capacity)
        return state

    @counted("step_end")
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
                              "add its forward to SCORED_ATTENTION in kvzap_export/integrations/sglang/api.py")
        req_to_token = batch.req_to_token_pool.req_to_token
        pending = []
        for i, req in enumerate(batch.reqs):
            idx = req.kv.req_pool_idx
            if idx is None:
                continue
            seq_len = int(batch.seq_lens_cpu[i])
            n = int(batch.extend_lens[i]) if extend else 1
            if extend and int(batch.prefix_lens[i]) == 0:
                state = self._start(req, idx, req_to_token.shape[0])
            else:
                state = self.states.get(idx)
                if state is None and extend and self.owners.get(idx) is not req:
                    # e.g. a streaming session's next turn: its cache was left alone, so it stays alone
                    self._bypass(req, idx, f"it extends a cache KVzap did not build (prefix {int(batch.prefix_lens[i])})")
            if state is None:
                continue
            row = req_to_token[idx, :seq_len]
            scores = self.slots.read(self.score_slots(idx, row, seq_len, n))
            prefill = state.phase == "prefill"
            if prefill and extend and req is chunked_req:
                state.append(scores)  # more prompt chunks follow: no decision yet
                continue
            pending.append((i, req, idx, row, state, state.feed(scores, prefill=prefill, last=True)))
        if pending:
            counts = [p[5].local_count for p in pending]
            if self.mode == "evict":
                counts = self._agree(counts)
            for (i, req, idx, row, state, proposal), count in zip(pending, counts):
                decision = state.commit(proposal, count if self.mode == "evict" else None)
                self.apply(batch, i, req, idx, row, decision, state)
                self._remember_visibility(idx, state, decision.uniform_count)

    def score_slots(self, idx: int, row: torch.Tensor, seq_len: int, n: int) -> torch.Tensor:
        """The slots where the scoring hook wrote the step's ``n`` new tokens of row ``idx``."""
        return row[seq_len - n:]

    def apply(self, batch, i: int, req, idx: int, row: torch.Tensor, decision, state: RequestState) -> None:
        """Carries a decision out in the engine (evict mode: moves K/V and frees the tail)."""
        if self.mode == "evict" and decision.freed:
            self._evict(batch, i, idx, row, decision, state, req)

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

    def _evict(self, batch, i: int, idx: int, row: torch.Tensor, decision, state: RequestState, req) -> None:
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

    # masking (decode attention of the mask and evict modes) ----------------------------------------
    def batch_visibility(self, rows: list[int], width: int, device) -> torch.Tensor:
        """bool [B, L, H, width]: ``visible`` of every layer of each request of a decode step, at once, from the
        masks each step end left (``_remember_visibility``): a step copies one tensor per request and reads
        nothing back. Entries past a request's remembered masks (this step's token) are visible."""
        out = torch.ones(len(rows), self.scorer.num_layers, self.scorer.num_kv_heads, width, dtype=torch.bool,
                         device=device)
        for b, idx in enumerate(rows):
            seen = self._visible.get(idx)
            if seen is not None:
                n = min(seen.shape[-1], width)
                out[b, :, :, :n] = seen[..., :n]
        return out

    def _remember_visibility(self, idx: int, state: RequestState, physical_length: int) -> None:
        """After a decision: bool [L, H, n], the entries of row ``idx`` attention may see (n: the state's logical
        length in mask mode, the request's physical length in evict mode)."""
        if self.mode == "evict":
            # A copy: the state's buffers are written in place by later appends, and a view would keep them alive.
            self._visible[idx] = state.rule_kept[..., :physical_length].clone()
        else:
            self._visible[idx] = state.visible_all()

    def visible(self, req_pool_idx: int, layer: int, kv_len: int) -> torch.Tensor:
        """bool [kv_heads, kv_len]: which of the request's ``kv_len`` cache entries each KV head may attend to.

        Mask mode: the engine holds every token, so entries are logical positions and the mask is kvpress's
        kept set. Evict mode: the engine holds the uniform layout (each head's kept set plus its best-scored
        evicted entries up to the shared count), so entries are the state's physical rows and the extras are
        masked: attention sees exactly kvpress's set. Entries the state has not seen yet (this step's token)
        are visible.
        """
        state = self.states.get(req_pool_idx)
        out = torch.ones(self.scorer.num_kv_heads, kv_len, dtype=torch.bool,
                         device=state.positions.device if state is not None else None)
        if state is None:
            return out
        if self.mode == "evict":
            seen = min(state.physical_length, kv_len)
            out[:, :seen] = state.rule_kept[layer][:, :seen]
        else:
            seen = min(state.logical_length, kv_len)
            out[:, :seen] = state.visible(layer)[:, :seen]
        return out
