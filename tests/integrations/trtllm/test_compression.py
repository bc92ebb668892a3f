"""The TensorRT-LLM glue's compression logic on the CPU, with stand-ins shaped like the engine's objects (TensorRT-LLM
cannot be installed here): paged ``[pages, 2, heads, tokens_per_block, dim]`` pools, ``LlmRequest``-like
requests. The SGLang glue is tested inside the real SGLang engine (tests/integrations/sglang/).
Each K/V entry stores its own logical position, so after every eviction the test reads back which token
each (layer, head, slot) holds and compares it with kvpress's decisions (reference) and the core state.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvzap_export.integrations.core import KVzapPolicy
from kvzap_export.integrations.scoring import BundleScorer
from tests.integrations.glue_shapes import DIM, HIDDEN, KV_HEADS, LAYERS, WINDOW, attention_metadata


def test_trtllm_compression_flow(surrogate):
    """Chunked context then generation: moves, logical counts and the published compressed-token count."""
    from kvzap_export.integrations.trtllm import KVzapCompression, KVzapScorer, attach_scorer, move_paged_kv

    scorer = KVzapScorer(BundleScorer(surrogate))

    class Attention(torch.nn.Module):  # TensorRT-LLM's Attention.forward(position_ids, hidden_states, attn_metadata)
        def forward(self, position_ids, hidden_states, attn_metadata):
            return hidden_states

    modules = [(i, Attention()) for i in range(LAYERS)]
    handles = attach_scorer(modules, scorer)
    tpb = 4
    pools = [torch.zeros(32, 2, KV_HEADS, tpb, DIM) for _ in range(LAYERS)]
    pages = torch.arange(3, 3 + 16)
    length = {"physical": 0}

    def mover(request, decision):
        for layer, pool in enumerate(pools):
            move_paged_kv(pool, pages, decision.indices[layer])
        length["physical"] = decision.uniform_count

    policy = KVzapPolicy(0.0, window=WINDOW)
    logic = KVzapCompression(scorer, policy, mover=mover)
    request = SimpleNamespace(py_request_id=7, context_chunk_size=0, py_num_compressed_tokens=0)
    logic.request_init(request)
    hidden = torch.randn(44, HIDDEN, generator=torch.Generator().manual_seed(4))

    def forward(tokens, positions, context):
        for p_idx, p in enumerate(positions):
            for pool in pools:
                t = length["physical"] + p_idx
                pool[pages[t // tpb], :, :, t % tpb] = float(p)
        metadata = attention_metadata([(7, len(positions))], num_contexts=1 if context else 0)
        for layer, module in modules:
            module(torch.tensor(positions), tokens, metadata)  # positional, as Attention.forward is called
        length["physical"] += len(positions)

    for start, stop, last in ((0, 20, False), (20, 36, True)):  # two context chunks
        request.context_chunk_size = stop - start
        forward(hidden[start:stop], list(range(start, stop)), context=True)
        request.context_chunk_size = 0  # moveToNextContextChunk() runs before the resource managers' update
        logic.step_end([request], [request] if last else [], [])
    for t in range(36, 44):
        forward(hidden[t: t + 1], [t], context=False)
        logic.step_end([], [], [request])
    state = logic.states[7]
    assert request.py_num_compressed_tokens == 44 - length["physical"] == state.num_compressed_tokens > 0
    for layer, pool in enumerate(pools):
        dense = pool[pages].permute(1, 2, 0, 3, 4).reshape(2, KV_HEADS, -1, DIM)[:, :, : length["physical"], 0]
        assert torch.equal(dense[0].to(torch.int64), state.positions[layer][:, : length["physical"]])  # then -1 padding
    for h in handles:
        h.remove()



def test_trtllm_dummy_requests_are_skipped_and_held_requests_keep_everything(surrogate):
    """A dummy request's token is in the forward but has no state; a held request decides and frees nothing."""
    from kvzap_export.integrations.trtllm import KVzapCompression, KVzapScorer

    scorer = KVzapScorer(BundleScorer(surrogate))
    moved = []
    held = {"on": True}
    logic = KVzapCompression(scorer, KVzapPolicy(0.0, window=2), mover=lambda r, d: moved.append(r.py_request_id),
                             skip=lambda r: getattr(r, "is_dummy", False), hold=lambda r: held["on"] and r.py_request_id == 1)
    a = SimpleNamespace(py_request_id=1, context_chunk_size=0, py_num_compressed_tokens=0)  # zeroed by the executor
    b = SimpleNamespace(py_request_id=2, context_chunk_size=0, py_num_compressed_tokens=0)
    dummy = SimpleNamespace(py_request_id=99, is_dummy=True, context_chunk_size=0, py_num_compressed_tokens=0)
    gen = torch.Generator().manual_seed(6)
    metadata = attention_metadata([(1, 30), (99, 30), (2, 30)], num_contexts=3)
    for layer in range(LAYERS):
        scorer.record(layer, torch.randn(90, HIDDEN, generator=gen), metadata)
    decisions = logic.step_end([a, dummy, b], [a, dummy, b], [])
    assert set(decisions) == {1, 2} and 99 not in logic.states
    assert decisions[1].freed == 0 and a.py_num_compressed_tokens == 0  # held: every entry stays
    assert decisions[2].freed > 0 and b.py_num_compressed_tokens > 0 and moved == [2]
    assert bool((logic.states[1].rule_kept.sum(-1) < 30).any())  # the rule's own set is still tracked
    held["on"] = False
    metadata = attention_metadata([(1, 1), (99, 1), (2, 1)], num_contexts=0)
    for layer in range(LAYERS):
        scorer.record(layer, torch.randn(3, HIDDEN, generator=gen), metadata)
    decisions = logic.step_end([], [], [a, dummy, b])
    assert decisions[1].freed > 0 and a.py_num_compressed_tokens == logic.states[1].num_compressed_tokens > 0


def test_trtllm_scores_are_split_by_the_forwards_own_layout(surrogate, caplog):
    """Sequences are matched by request id, whatever the scheduled order; a generation request whose prompt
    KVzap never scored is left alone (once told); a multi-token generation step is refused."""
    from kvzap_export.errors import ConfigError
    from kvzap_export.integrations.trtllm import KVzapCompression, KVzapScorer

    scorer = KVzapScorer(BundleScorer(surrogate))
    logic = KVzapCompression(scorer, KVzapPolicy(0.0, window=2))
    a, b = (SimpleNamespace(py_request_id=i, py_num_compressed_tokens=0) for i in (1, 2))
    hidden = torch.randn(30, HIDDEN, generator=torch.Generator().manual_seed(7))
    metadata = attention_metadata([(2, 10), (1, 20)], num_contexts=2)  # packed b first
    for layer in range(LAYERS):
        scorer.record(layer, hidden, metadata)
    logic.step_end([a, b], [a, b], [])  # scheduled a first
    with torch.no_grad():
        want = torch.stack([scorer.scorer.score(layer, hidden).T for layer in range(LAYERS)])
    assert logic.states[1].logical_length == 20 and logic.states[2].logical_length == 10
    kept = logic.states[1].positions[0, 0, : int(logic.states[1].counts[0, 0])]
    assert torch.equal(logic.states[1].scores[0, 0, : kept.numel()], want[0, 0, 10 + kept])
    stranger = SimpleNamespace(py_request_id=5, py_num_compressed_tokens=0)
    metadata = attention_metadata([(1, 1), (5, 1)], num_contexts=0)
    for layer in range(LAYERS):
        scorer.record(layer, hidden[:2], metadata)
    with caplog.at_level("WARNING", logger="kvzap_export.integrations.trtllm"):
        decisions = logic.step_end([], [], [a, stranger])
    assert set(decisions) == {1} and 5 not in logic.states and "leaves request 5 alone" in caplog.text
    metadata = attention_metadata([(1, 3)], num_contexts=0)
    for layer in range(LAYERS):
        scorer.record(layer, hidden[:3], metadata)
    with pytest.raises(ConfigError, match="fed 3 tokens in one step"):
        logic.step_end([], [], [a])



def test_trtllm_finished_requests_are_skipped():
    from kvzap_export.integrations.trtllm import skip_request

    assert skip_request(SimpleNamespace(is_dummy=True))
    assert skip_request(SimpleNamespace(state=SimpleNamespace(name="GENERATION_COMPLETE")))
    assert not skip_request(SimpleNamespace(state=SimpleNamespace(name="GENERATION_IN_PROGRESS")))
    assert not skip_request(SimpleNamespace())
