"""The compression manager's decisions at each step end (engine-free): scores split per request by the forward's
layout, each request's ``RequestState``, counts agreed across ranks, K/V moved through a ``mover``."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from kvzap_export.errors import ConfigError, InputError
from kvzap_export.integrations.core import KVzapPolicy, RequestState
from kvzap_export.integrations.trtllm.scoring import KVzapScorer

log = logging.getLogger(__name__)


def skip_request(request) -> bool:
    """Requests whose tokens are in the forward but which KVzap does not touch: TensorRT-LLM's dummy padding
    requests, and requests already complete (their cache is released next) — as TriAttention skips them."""
    if getattr(request, "is_dummy", False):
        return True
    state = getattr(request, "state", None)
    return getattr(state, "name", None) == "GENERATION_COMPLETE"


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
