"""The engine glue's own logic on the CPU, with stand-ins shaped like the engines' objects.

SGLang: slots, ``req_to_token`` rows, per-layer ``[slots, heads, dim]`` K/V buffers, an allocator;
TensorRT-LLM: paged ``[pages, 2, heads, tokens_per_block, dim]`` pools, ``LlmRequest``-like requests.
Each K/V entry stores its own logical position, so after every eviction the test reads back which token
each (layer, head, slot) holds and compares it with kvpress's decisions (reference) and the core state.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvzap_export.integrations.core import BundleScorer, KVzapPolicy
from kvzap_export.surrogate.model import Surrogate, SurrogateConfig
from tests.integrations.kvpress_reference import kvpress_masked

LAYERS, KV_HEADS, HIDDEN, DIM = 3, 2, 16, 4
WINDOW = 6


@pytest.fixture(scope="module")
def surrogate():
    torch.manual_seed(3)
    return Surrogate(SurrogateConfig(HIDDEN, KV_HEADS, LAYERS, None)).eval()


def mode(extend: bool):
    return SimpleNamespace(is_extend=lambda: extend, is_decode=lambda: not extend)


# ---- SGLang ---------------------------------------------------------------------------------------

class FakeSGLang:
    """One request in an SGLang-shaped world: pools, allocator, batch, forward batches."""

    def __init__(self, num_slots=64):
        self.k = [torch.full((num_slots, KV_HEADS, DIM), -1.0) for _ in range(LAYERS)]
        self.v = [torch.full((num_slots, KV_HEADS, DIM), -1.0) for _ in range(LAYERS)]
        self.free = list(range(num_slots - 1, 0, -1))  # slot 0 is SGLang's padding slot
        self.req_to_token = torch.zeros(4, 128, dtype=torch.int32)
        kvcache = SimpleNamespace(get_key_buffer=lambda layer: self.k[layer], get_value_buffer=lambda layer: self.v[layer])
        self.allocator = SimpleNamespace(free=lambda idx: self.free.extend(idx.tolist()), get_kvcache=lambda: kvcache)
        self.done = False
        self.req = SimpleNamespace(kv=SimpleNamespace(req_pool_idx=2, kv_committed_len=0, kv_allocated_len=0),
                                   finished=lambda: self.done, rid="r0")
        self.seq_len = 0
        self.logical = 0

    def forward(self, runtime, hidden: torch.Tensor, extend: bool):
        """Allocates slots, writes K/V (= logical positions), runs the scoring hook, then the step end."""
        n = hidden.shape[0]
        slots = torch.tensor([self.free.pop() for _ in range(n)], dtype=torch.int64)
        row = self.req_to_token[2]
        row[self.seq_len: self.seq_len + n] = slots.to(torch.int32)
        prefix = self.seq_len
        self.seq_len += n
        self.req.kv.kv_allocated_len = self.req.kv.kv_committed_len = self.seq_len  # SGLang's own bookkeeping
        positions = torch.arange(prefix, prefix + n)
        fb = SimpleNamespace(forward_mode=mode(extend), out_cache_loc=slots, req_pool_indices=torch.tensor([2]),
                             seq_lens=torch.tensor([self.seq_len]), positions=positions,
                             extend_seq_lens=torch.tensor([n]) if extend else None,
                             extend_prefix_lens=torch.tensor([prefix]) if extend else None)
        runtime.shift_positions(fb)
        assert fb.positions.tolist() == list(range(self.logical, self.logical + n))  # RoPE stays logical
        for layer in range(LAYERS):
            self.k[layer][slots] = fb.positions.float()[:, None, None].expand(n, KV_HEADS, DIM)
            self.v[layer][slots] = -fb.positions.float()[:, None, None].expand(n, KV_HEADS, DIM)
            runtime.score(layer, hidden, fb)
        self.logical += n
        batch = SimpleNamespace(forward_mode=mode(extend), reqs=[self.req],
                                req_to_token_pool=SimpleNamespace(req_to_token=self.req_to_token),
                                token_to_kv_pool_allocator=self.allocator, seq_lens=torch.tensor([self.seq_len]),
                                seq_lens_cpu=torch.tensor([self.seq_len]), orig_seq_lens=torch.tensor([self.seq_len]),
                                seq_lens_sum=self.seq_len, prefix_lens=[prefix], extend_lens=[n])
        runtime.on_step_end(batch)
        self.seq_len = int(batch.seq_lens_cpu[0])
        assert int(batch.seq_lens[0]) == self.seq_len == self.req.kv.kv_allocated_len == self.req.kv.kv_committed_len

    def held(self, layer: int) -> torch.Tensor:
        """Logical positions held per head: [H, seq_len]."""
        slots = self.req_to_token[2, : self.seq_len].to(torch.int64)
        k = self.k[layer][slots, :, 0].T
        assert torch.equal(self.v[layer][slots, :, 0].T, -k)
        return k.to(torch.int64)


@pytest.mark.parametrize("mixed", [False, True], ids=["decode_batches", "mixed_chunk"])
@pytest.mark.parametrize("decoding", [True, False], ids=["decoding", "prefill_only"])
def test_sglang_evict_mode_frees_slots_and_keeps_kvpress_sets(surrogate, decoding, mixed):
    """mixed: the generated tokens arrive as one-token rows of extend batches (``--enable-mixed-chunk``),
    which must still be decode steps for the request's state."""
    from kvzap_export.integrations.sglang import KVzapSGLang

    scorer = BundleScorer(surrogate)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40 + 12, HIDDEN, generator=g)
    with torch.no_grad():
        all_scores = torch.stack([scorer.score(layer, hidden).T for layer in range(LAYERS)])
    threshold = float(all_scores.median())
    runtime = KVzapSGLang(scorer, KVzapPolicy(threshold, window=WINDOW, decoding=decoding), mode="evict")
    world = FakeSGLang()
    free_before = len(world.free)
    world.forward(runtime, hidden[:40], extend=True)
    for t in range(40, 52):
        world.forward(runtime, hidden[t: t + 1], extend=mixed)
    steps = [all_scores[..., :40]] + [all_scores[..., t: t + 1] for t in range(40, 52)]
    expected = ~kvpress_masked(steps, threshold, WINDOW, decoding)
    assert runtime.states[2].phase == "decode" and runtime.states[2].prompt_length == 40
    state = runtime.states[2]
    assert world.seq_len == state.physical_length < 52 and state.logical_length == 52
    assert len(world.free) == free_before - world.seq_len  # every evicted slot went back to the allocator
    for layer in range(LAYERS):
        held = world.held(layer)
        assert torch.equal(held, state.positions[layer, :, : world.seq_len])
        for h in range(KV_HEADS):
            assert set(torch.nonzero(expected[layer, h]).flatten().tolist()) <= set(held[h].tolist())
        assert torch.equal(state.visible(layer), expected[layer])


def test_sglang_positions_of_a_reused_request_row_start_at_zero(surrogate):
    from kvzap_export.integrations.sglang import KVzapSGLang

    runtime = KVzapSGLang(BundleScorer(surrogate), KVzapPolicy(0.0), mode="evict")
    runtime._set_offset(2, 17, 4)  # the row's previous request had evicted 17 tokens
    fb = SimpleNamespace(forward_mode=mode(True), positions=torch.tensor([0, 1, 2, 5, 6]), req_pool_indices=torch.tensor([2, 1]),
                         extend_seq_lens=torch.tensor([3, 2]), extend_prefix_lens=torch.tensor([0, 5]))
    runtime._set_offset(1, 4, 4)
    runtime.shift_positions(fb)
    assert fb.positions.tolist() == [0, 1, 2, 9, 10]
    decode = SimpleNamespace(forward_mode=mode(False), positions=torch.tensor([30, 8]), req_pool_indices=torch.tensor([2, 1]),
                             extend_seq_lens=None, extend_prefix_lens=None)
    runtime.shift_positions(decode)
    assert decode.positions.tolist() == [47, 12]


def test_sglang_finished_request_state_is_dropped_and_its_row_restarts(surrogate):
    from kvzap_export.integrations.sglang import KVzapSGLang

    runtime = KVzapSGLang(BundleScorer(surrogate), KVzapPolicy(0.0, window=WINDOW), mode="evict")
    world = FakeSGLang()
    hidden = torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(4))
    world.forward(runtime, hidden, extend=True)
    world.forward(runtime, hidden[:1], extend=False)
    assert 2 in runtime.states and int(runtime.offsets[2]) == 21 - world.seq_len > 0
    world.done = True  # SGLang marks it in process_batch_result, after this step's hook
    assert 2 in runtime.states
    runtime.on_step_end(SimpleNamespace(forward_mode=mode(False), reqs=[]))  # the next step end: dropped
    assert runtime.states == {} and runtime.owners == {} and int(runtime.offsets[2]) == 0
    world.done, world.seq_len, world.logical = False, 0, 0  # a new request takes the row: positions from 0
    world.forward(runtime, hidden[:4], extend=True)
    assert runtime.states[2].logical_length == 4 and runtime.owners[2] is world.req


@pytest.mark.parametrize("sharing", ["beam_search", "streaming_session"])
def test_sglang_requests_sharing_kv_slots_are_left_alone(surrogate, sharing, caplog):
    """Beams read the prompt's slots; a streaming session's next turn reuses the cache by its logical length.
    Compacting either would corrupt another reader, so KVzap neither scores into a state nor evicts, and says
    so once per request; the session's next turn (prefix > 0, no state) is left alone too."""
    from kvzap_export.integrations.sglang import KVzapSGLang

    runtime = KVzapSGLang(BundleScorer(surrogate), KVzapPolicy(1e9, window=WINDOW), mode="evict")  # τ evicts all it may
    world = FakeSGLang()
    if sharing == "beam_search":
        world.req.beam_group = SimpleNamespace(leader=world.req)
    else:
        world.req.session = SimpleNamespace(streaming=True)
    free_before = len(world.free)
    hidden = torch.randn(30, HIDDEN, generator=torch.Generator().manual_seed(5))
    with caplog.at_level("WARNING", logger="kvzap_export.integrations.sglang"):
        world.forward(runtime, hidden[:20], extend=True)
        world.forward(runtime, hidden[20:21], extend=False)
        if sharing == "streaming_session":  # the turn ends; the next one extends the same row
            world.done = True
            runtime.on_step_end(SimpleNamespace(forward_mode=mode(False), reqs=[]))
            world.done = False
            world.forward(runtime, hidden[21:30], extend=True)
    assert runtime.states == {} and world.seq_len == world.logical and len(world.free) == free_before - world.seq_len
    assert torch.equal(world.held(0), torch.arange(world.seq_len).expand(KV_HEADS, -1))  # nothing moved
    told = [r.getMessage() for r in caplog.records if "leaves request 'r0' alone" in r.getMessage()]
    assert len(told) == (1 if sharing == "beam_search" else 2)


def test_sglang_a_row_reused_by_a_decode_request_does_not_inherit_offsets(surrogate):
    """A row freed after the last step end may hold a new request whose first forward is a decode (a beam
    forked from its leader): the positions hook forgets the finished owner before shifting."""
    from kvzap_export.integrations.sglang import KVzapSGLang

    runtime = KVzapSGLang(BundleScorer(surrogate), KVzapPolicy(1e9, window=WINDOW), mode="evict")
    world = FakeSGLang()
    world.forward(runtime, torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(6)), extend=True)
    assert int(runtime.offsets[2]) == 20 - WINDOW
    world.done = True  # finished in process_batch_result, after the step-end hook
    fb = SimpleNamespace(forward_mode=mode(False), positions=torch.tensor([9]), req_pool_indices=torch.tensor([2]),
                         extend_seq_lens=None, extend_prefix_lens=None)
    runtime.shift_positions(fb)
    assert fb.positions.tolist() == [9] and runtime.states == {} and int(runtime.offsets[2]) == 0


def good_setup(**changes):
    from kvzap_export.integrations.sglang import ServerSetup

    base = dict(radix_cache=False, overlap=False, page_size=1, speculative=False, mixed_chunk=False,
                unified_memory=False, dcp_size=1, pp_size=1, attn_dp_size=1, disaggregation="null",
                kv_dtype=torch.bfloat16, kv_quantized=False, kv_slots=4096)
    return ServerSetup(**{**base, **changes})


@pytest.mark.parametrize("change, modes, flag", [
    ({"radix_cache": True}, ("evict", "mask"), "--disable-radix-cache"),
    ({"overlap": True}, ("evict", "mask"), "--disable-overlap-schedule"),
    ({"speculative": True}, ("evict", "mask"), "--speculative-algorithm"),
    ({"unified_memory": True}, ("evict", "mask"), "--enable-unified-memory"),
    ({"dcp_size": 2}, ("evict", "mask"), "--dcp-size 1"),
    ({"pp_size": 2}, ("evict", "mask"), "--pp-size 1"),
    ({"attn_dp_size": 4}, ("evict", "mask"), "--attn-dp-size 1"),
    ({"disaggregation": "decode"}, ("evict", "mask"), "--disaggregation-mode"),
    ({"mixed_chunk": True}, ("mask",), "--enable-mixed-chunk"),
    ({"page_size": 16}, ("evict",), "--page-size 1"),
    ({"kv_dtype": torch.float8_e4m3fn}, ("evict",), "--kv-cache-dtype auto"),
    ({"kv_quantized": True}, ("evict",), "--kv-cache-dtype auto"),
])
def test_sglang_server_setup_names_the_flag_to_fix(surrogate, change, modes, flag):
    from kvzap_export.errors import ConfigError
    from kvzap_export.integrations.sglang import KVzapSGLang

    assert good_setup().problems("evict") == [] and good_setup().problems("mask") == []
    for m in ("evict", "mask"):
        layout = "uniform" if m == "evict" else "ragged"
        runtime = KVzapSGLang(BundleScorer(surrogate), KVzapPolicy(0.0, layout=layout), mode=m)
        problems = good_setup(**change).problems(m)
        if m in modes:
            assert len(problems) == 1 and flag in problems[0]
            with pytest.raises(ConfigError, match=flag) as err:
                runtime.check_setup(good_setup(**change))
            assert "\n" not in str(err.value) and runtime.setup is None
        else:
            assert problems == []
            runtime.check_setup(good_setup(**change))
            assert runtime.setup is not None


def test_sglang_server_setup_read_from_the_scheduler(monkeypatch):
    """``ServerSetup.of`` reads the scheduler's fields (names checked against 0.5.23 in test_sglang_api)."""
    from kvzap_export.integrations import sglang

    context = SimpleNamespace(get_memory=lambda: SimpleNamespace(enable_unified_memory=False),
                              get_parallel=lambda: SimpleNamespace(dcp_size=1, pp_size=1, attn_dp_size=1),
                              get_disagg=lambda: SimpleNamespace(disaggregation_mode="null"))
    monkeypatch.setattr(sglang, "_sglang", lambda module: context)
    kv = SimpleNamespace(dtype=torch.float16, is_quantized_kv_cache=False, size=1000, page_size=1)
    scheduler = SimpleNamespace(tree_cache=SimpleNamespace(disable=True), enable_overlap=False, page_size=1,
                                spec_algorithm=SimpleNamespace(is_none=lambda: True), is_mixed_chunk=True,
                                token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: kv))
    setup = sglang.ServerSetup.of(scheduler)
    assert setup == good_setup(kv_dtype=torch.float16, kv_slots=1001, mixed_chunk=True)
    scheduler.tree_cache = SimpleNamespace()  # a prefix cache without a ``disable`` switch counts as on
    assert sglang.ServerSetup.of(scheduler).radix_cache


def test_sglang_score_buffer_sized_for_the_pool_once_checked(surrogate):
    from kvzap_export.integrations.sglang import KVzapSGLang

    runtime = KVzapSGLang(BundleScorer(surrogate), KVzapPolicy(0.0, window=WINDOW), mode="evict")
    world = FakeSGLang()
    world.forward(runtime, torch.randn(5, HIDDEN), extend=True)
    assert runtime.slots.buffer.shape[1] == 1024  # grown on demand before the check
    runtime.check_setup(good_setup(kv_slots=5000))
    assert runtime.slots.buffer.shape == (LAYERS, 5000, KV_HEADS)
    world.forward(runtime, torch.randn(1, HIDDEN), extend=False)
    assert runtime.slots.buffer.shape == (LAYERS, 5000, KV_HEADS)


@pytest.mark.gpu
def test_sglang_scoring_refuses_cuda_graph_capture(surrogate):
    from kvzap_export.errors import ConfigError
    from kvzap_export.integrations.sglang import KVzapSGLang

    runtime = KVzapSGLang(BundleScorer(surrogate.cuda()), KVzapPolicy(0.0), mode="evict")
    fb = SimpleNamespace(out_cache_loc=torch.arange(1, 5, device="cuda"))
    hidden = torch.randn(4, HIDDEN, device="cuda")
    with pytest.raises(ConfigError, match="cuda-graph-backend"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            runtime.score(0, hidden, fb)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_sglang_mask_mode_matches_per_head_masked_attention(surrogate):
    from torch.nn.attention.flex_attention import flex_attention

    from kvzap_export.integrations.sglang import KVzapSGLang

    scorer = BundleScorer(surrogate)
    hidden = torch.randn(30, HIDDEN, generator=torch.Generator().manual_seed(1))
    policy = KVzapPolicy(0.0, window=WINDOW, layout="ragged")
    runtime = KVzapSGLang(scorer, policy, mode="mask")
    world = FakeSGLang()
    world.forward(runtime, hidden, extend=True)
    assert world.seq_len == 30  # masking frees nothing
    q_heads = 2 * KV_HEADS
    layer = SimpleNamespace(layer_id=1, tp_q_head_num=q_heads, tp_k_head_num=KV_HEADS)
    fb = SimpleNamespace(req_pool_indices=torch.tensor([2]), seq_lens=torch.tensor([31]))
    (mask,) = runtime.decode_block_masks(layer, fb, "cpu")
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, q_heads, 1, DIM, generator=g), torch.randn(1, KV_HEADS, 31, DIM, generator=g), torch.randn(
        1, KV_HEADS, 31, DIM, generator=g)
    visible = runtime.visible(2, 1, 31)
    assert visible[:, 30].all() and torch.equal(visible[:, :30], runtime.states[2].visible(1))
    assert not visible.all()  # something is masked at this threshold
    ours = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible.repeat_interleave(2, 0)[None, :, None],
                                                           enable_gqa=True)
    assert torch.allclose(ours, ref, atol=1e-5)


# ---- TensorRT-LLM ------------------------------------------------------------------------------------

def test_paged_move_matches_dense_gather():
    from kvzap_export.integrations.trtllm import move_paged_kv

    tpb, pages = 4, torch.tensor([5, 2, 7])
    pool = torch.randn(8, 2, KV_HEADS, tpb, DIM)
    dense = pool[pages].permute(1, 2, 0, 3, 4).reshape(2, KV_HEADS, -1, DIM).clone()  # [2, H, tokens, D]
    indices = torch.tensor([[0, 3, 4, 9, 11], [1, 2, 5, 6, 10]])
    move_paged_kv(pool, pages, indices)
    after = pool[pages].permute(1, 2, 0, 3, 4).reshape(2, KV_HEADS, -1, DIM)
    for h in range(KV_HEADS):
        assert torch.equal(after[:, h, :5], dense[:, h, indices[h]])


def attention_metadata(requests: list[tuple[int, int]], num_contexts: int):
    """The fields of TensorRT-LLM's ``AttentionMetadata`` KVzap reads: per sequence its request id and query
    tokens (``seq_lens``, a CPU tensor), context sequences first."""
    return SimpleNamespace(request_ids=[rid for rid, _ in requests], seq_lens=torch.tensor([n for _, n in requests]),
                           num_contexts=num_contexts, is_cuda_graph=False)


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
        assert torch.equal(dense[0].to(torch.int64), state.positions[layer])
    for h in handles:
        h.remove()


def test_context_sparse_kv_layout(surrogate):
    from kvzap_export.integrations.core import context_budget
    from kvzap_export.integrations.trtllm import context_sparse_kv

    scorer = BundleScorer(surrogate)
    hidden = torch.randn(50 + 9, HIDDEN, generator=torch.Generator().manual_seed(5))
    layer_scores = scorer.score(0, hidden)
    policy = KVzapPolicy(0.0, window=WINDOW)
    indices, offsets = context_sparse_kv(layer_scores, [50, 9], policy, keep_fraction=0.4)
    budgets = [context_budget(50, 0.4, WINDOW), context_budget(9, 0.4, WINDOW)]
    assert budgets == [20, 6]
    assert indices.shape == (KV_HEADS, sum(budgets)) and indices.dtype == torch.int32 and offsets.dtype == torch.int32
    assert offsets.tolist() == [0, 20, 26]
    assert bool((indices[:, 20:] < 9).all()) and bool((indices[:, 14:20] == torch.arange(44, 50, dtype=torch.int32)).all())


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


def test_trtllm_resize_tail_pages_and_capacity():
    from kvzap_export.errors import ConfigError
    from kvzap_export.integrations.trtllm import cache_pages, check_pool, compaction_capacity, reserved_tail

    manager = SimpleNamespace(num_extra_kv_tokens=2,
                              get_batch_cache_indices=lambda ids, layer: [[4, 9, -1, 6]] if ids == [7] and layer == 5 else None)
    assert reserved_tail(manager) == 2 and reserved_tail(SimpleNamespace()) == 0
    assert cache_pages(manager, 7, 5, tokens=8, tokens_per_block=4).tolist() == [4, 9, -1, 6]  # -1 stays in place
    with pytest.raises(ConfigError, match="sliding-window"):
        cache_pages(manager, 7, 5, tokens=9, tokens_per_block=4)  # block 2 is needed and was dropped
    with pytest.raises(ConfigError, match="sliding-window"):
        cache_pages(manager, 7, 5, tokens=17, tokens_per_block=4)  # more blocks than the cache has
    # The history (the prompt) never shrinks: evicted prompt entries keep their pages; decoding gives them back.
    assert compaction_capacity(count=40, tail=2, history_length=100) == 100
    assert compaction_capacity(count=140, tail=2, history_length=100) == 142
    check_pool(torch.zeros(4, 2, KV_HEADS, 4, DIM, dtype=torch.bfloat16), KV_HEADS, 0)
    with pytest.raises(ConfigError, match="packed"):
        check_pool(torch.zeros(4, 2, KV_HEADS, 4, DIM, dtype=torch.uint8), KV_HEADS, 3)
    with pytest.raises(ConfigError, match="holds 4 heads, KVzap's surrogate slice 2"):
        check_pool(torch.zeros(4, 2, 4, 4, DIM), KV_HEADS, 1)


def test_trtllm_prompt_lens_clamped_for_generation_requests_only():
    from kvzap_export.integrations.trtllm import clamp_prompt_lens

    assert clamp_prompt_lens([100, 40, 100, 10], 2, lambda p: p // 2) == [100, 40, 50, 5]


def test_trtllm_scorer_refuses_quantized_input_and_fused_rope(surrogate, monkeypatch):
    from kvzap_export.errors import ConfigError
    from kvzap_export.integrations import trtllm

    scorer = trtllm.KVzapScorer(BundleScorer(surrogate))
    with pytest.raises(ConfigError, match="layer 1: the attention input is torch.uint8"):
        scorer.record(1, torch.zeros(4, HIDDEN, dtype=torch.uint8))
    with pytest.raises(ConfigError, match="not float16/bfloat16/float32"):
        scorer.record(0, SimpleNamespace(shape=(4, HIDDEN)))
    with pytest.raises(ConfigError, match="torch.float8_e4m3fn, not float16"):  # is_floating_point() is True for it
        scorer.record(0, torch.zeros(4, HIDDEN, dtype=torch.float8_e4m3fn))
    graph = SimpleNamespace(is_cuda_graph=True, request_ids=[1], seq_lens=torch.tensor([4]), num_contexts=1)
    with pytest.raises(ConfigError, match="cuda_graph_config=None"):
        scorer.record(0, torch.zeros(4, HIDDEN), graph)
    fused = torch.nn.Identity()
    fused.rope_fusion = True
    monkeypatch.setattr(trtllm.process, "STATE", {"evicts": True})
    with pytest.raises(ConfigError, match="layer 0 fuses RoPE"):
        trtllm.attach_scorer([(0, fused)], scorer)
    monkeypatch.setattr(trtllm.process, "STATE", {"evicts": False})  # context-only 1.2.x path: nothing is evicted later
    assert len(trtllm.attach_scorer([(0, fused)], scorer)) == 1


# Stand-in of tensorrt_llm/llmapi/llm_args.py @ af8c3bfa, as far as the compression config goes: a strict
# pydantic config base keyed by `algorithm`, and LLM arguments validating a union discriminated on it.
LLM_ARGS = '''
from typing import Annotated, ClassVar, Literal, Optional, Union
from pydantic import BaseModel, ConfigDict, Field

class StrictBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

class KvCacheCompressionConfig(StrictBaseModel):
    changes_physical_kv_length: ClassVar[bool] = False
    algorithm: str = Field(...)
    def supports_block_reuse(self) -> bool:
        return False
    def supports_speculative_decoding(self) -> bool:
        return False

class ColdPageQuantizationCompressionConfig(KvCacheCompressionConfig):
    algorithm: Literal["quantization_for_cold_page"] = "quantization_for_cold_page"

class TriAttentionKvCacheCompressionConfig(KvCacheCompressionConfig):
    changes_physical_kv_length: ClassVar[bool] = True
    algorithm: Literal["triattention"] = "triattention"

KvCacheCompressionConfigType = Annotated[Union[ColdPageQuantizationCompressionConfig,
                                               TriAttentionKvCacheCompressionConfig], Field(discriminator="algorithm")]

class BaseLlmArgs(StrictBaseModel):
    kv_cache_compression_config: Optional[KvCacheCompressionConfigType] = None

class TorchLlmArgs(BaseLlmArgs):
    backend: str = "pytorch"
'''


@pytest.fixture
def stand_in_llm_args(tmp_path, monkeypatch):
    pytest.importorskip("pydantic", reason="the stand-in LLM arguments are pydantic models, as TensorRT-LLM's")
    import importlib
    import sys

    from kvzap_export.integrations import trtllm

    package = tmp_path / "tensorrt_llm"
    (package / "llmapi").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "llmapi" / "__init__.py").write_text("")
    (package / "llmapi" / "llm_args.py").write_text(LLM_ARGS)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "tensorrt_llm" or m.startswith("tensorrt_llm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(trtllm.process, "STATE", {})
    yield importlib.import_module("tensorrt_llm.llmapi.llm_args")
    for name in [m for m in sys.modules if m == "tensorrt_llm" or m.startswith("tensorrt_llm.")]:
        sys.modules.pop(name)


def test_trtllm_llm_args_accept_the_kvzap_config(stand_in_llm_args):
    import pydantic

    from kvzap_export.integrations import trtllm

    llm_args = stand_in_llm_args
    with pytest.raises(pydantic.ValidationError):  # what LLM(...) does before install()
        llm_args.TorchLlmArgs(kv_cache_compression_config={"algorithm": "kvzap"})
    trtllm.compression_manager.accept_in_llm_args()
    trtllm.compression_manager.accept_in_llm_args()  # idempotent
    config = trtllm.compression_config()
    assert config.algorithm == "kvzap" and type(config).changes_physical_kv_length
    assert not config.supports_block_reuse() and not config.supports_speculative_decoding()
    for args in (llm_args.TorchLlmArgs, llm_args.BaseLlmArgs):
        assert args(kv_cache_compression_config=config).kv_cache_compression_config is config
        assert type(args(kv_cache_compression_config={"algorithm": "kvzap"}).kv_cache_compression_config) is type(config)
        tri = args(kv_cache_compression_config={"algorithm": "triattention"}).kv_cache_compression_config
        assert isinstance(tri, llm_args.TriAttentionKvCacheCompressionConfig)  # the engine's own still validate
        with pytest.raises(pydantic.ValidationError):
            args(kv_cache_compression_config={"algorithm": "nope"})


# Stand-in of tensorrt_llm/_torch/pyexecutor/resource_manager.py @ af8c3bfa, as far as the compression framework
# goes: the base class and how PyExecutor's resource-manager calls reach its hooks.
RESOURCE_MANAGER = '''
class KVCacheCompressionManager:
    def __init__(self, config):
        self.config = config
        self.kv_cache_manager = None

    def bind_kv_cache_managers(self, kv_cache_manager, draft_kv_cache_manager=None):
        self.kv_cache_manager = kv_cache_manager

    def prepare_resources(self, scheduled_batch):
        for req in scheduled_batch.context_requests:
            if req.is_first_context_chunk:
                self.on_request_init(req)
        self.on_generation_step_begin(scheduled_batch)

    def update_resources(self, scheduled_batch, attn_metadata=None, kv_cache_dtype_byte_size=None):
        self.on_generation_step_end(scheduled_batch)

    def free_resources(self, request):
        self.on_request_finish(request)
'''


class StandInCache:
    """``_KVCache`` of KV cache manager V2 as far as KVzap uses it: history never decreases, and a capacity
    below it is an error (``resize(capacity, None)`` keeps the history)."""

    def __init__(self):
        self.capacity, self.history_length, self.is_active = 0, 0, True

    def resize(self, capacity, history_length=None):
        history = self.history_length if history_length is None else history_length
        if history < self.history_length:
            raise ValueError("History length cannot be decreased")
        if capacity is not None and capacity < history:
            raise ValueError("History length cannot be greater than capacity")
        self.capacity, self.history_length = capacity if capacity is not None else self.capacity, history
        return True


class StandInKVCacheManagerV2:
    """Paged HND pools (one page list per request, shared by the layers) and the per-request caches."""

    def __init__(self, tpb=4, pages=64):
        self.tokens_per_block, self.num_extra_kv_tokens, self.pp_layers = tpb, 0, list(range(LAYERS))
        self.pools = [torch.full((pages, 2, KV_HEADS, tpb, DIM), -1.0) for _ in range(LAYERS)]
        self.kv_cache_map, self.pages, self.free = {}, {}, list(range(pages))

    def get_buffers(self, layer, kv_layout="HND"):
        assert kv_layout == "HND"
        return self.pools[layer]

    def get_batch_cache_indices(self, request_ids, layer):
        return [self.pages[rid][: -(-self.kv_cache_map[rid].capacity // self.tokens_per_block)] for rid in request_ids]

    def grow(self, rid, capacity):  # what the executor's allocation does before a forward
        cache = self.kv_cache_map.setdefault(rid, StandInCache())
        pages = self.pages.setdefault(rid, [])
        while len(pages) * self.tokens_per_block < capacity:
            pages.append(self.free.pop(0))
        cache.capacity = max(cache.capacity, capacity)


@pytest.fixture
def stand_in_resource_manager(tmp_path, monkeypatch, surrogate):
    import importlib
    import sys

    from kvzap_export.integrations import trtllm

    package = tmp_path / "tensorrt_llm" / "_torch" / "pyexecutor"
    package.mkdir(parents=True)
    for init in (tmp_path / "tensorrt_llm", tmp_path / "tensorrt_llm" / "_torch", package):
        (init / "__init__.py").write_text("")
    (package / "resource_manager.py").write_text(RESOURCE_MANAGER)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "tensorrt_llm" or m.startswith("tensorrt_llm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(trtllm.process, "STATE", {"scorer": trtllm.KVzapScorer(BundleScorer(surrogate)), "world": 1})
    importlib.import_module("tensorrt_llm._torch.pyexecutor.resource_manager")
    yield trtllm
    for name in [m for m in sys.modules if m == "tensorrt_llm" or m.startswith("tensorrt_llm.")]:
        sys.modules.pop(name)


def test_trtllm_manager_compacts_through_the_executor_flow(stand_in_resource_manager):
    """Chunked prefill then decoding, driven as PyExecutor drives resource managers: K/V hold the kept entries,
    the capacity never goes below the prompt (history), decoding past it gives pages back."""
    trtllm = stand_in_resource_manager
    manager = trtllm.compression_manager_class()(SimpleNamespace(algorithm="kvzap"), KVzapPolicy(0.0, window=WINDOW))
    v2 = StandInKVCacheManagerV2()
    manager.bind_kv_cache_managers(v2)
    request = SimpleNamespace(py_request_id=3, py_num_compressed_tokens=0, is_first_context_chunk=True,
                              context_chunk_size=0, state=SimpleNamespace(name="CONTEXT_INIT"))
    hidden = torch.randn(60, HIDDEN, generator=torch.Generator().manual_seed(8))
    prompt, logical = 24, 0

    def step(positions, context, last):
        nonlocal logical
        batch = SimpleNamespace(context_requests=[request] if context else [],
                                context_requests_last_chunk=[request] if last else [],
                                generation_requests=[] if context else [request])
        manager.prepare_resources(batch)
        physical = logical - request.py_num_compressed_tokens
        v2.grow(3, physical + len(positions))
        for layer, pool in enumerate(v2.pools):  # the forward writes K/V at the physical end ...
            for i, p in enumerate(positions):
                t = physical + i
                pool[v2.pages[3][t // v2.tokens_per_block], :, :, t % v2.tokens_per_block] = float(p)
        metadata = attention_metadata([(3, len(positions))], num_contexts=1 if context else 0)
        for layer in range(LAYERS):  # ... and the attention pre-hooks score its hidden states
            trtllm.scorer().record(layer, hidden[positions[0]: positions[-1] + 1], metadata)
        logical += len(positions)
        request.context_chunk_size, request.is_first_context_chunk = 0, False  # moveToNextContextChunk()
        if last:
            v2.kv_cache_map[3].history_length = prompt  # update_context_resources: the prompt is history
        manager.update_resources(batch)

    step(list(range(0, 10)), context=True, last=False)
    assert request.py_num_compressed_tokens == 0  # no decision between chunks
    step(list(range(10, prompt)), context=True, last=True)
    request.state = SimpleNamespace(name="GENERATION_IN_PROGRESS")
    cache, state = v2.kv_cache_map[3], manager.kvzap.states[3]
    assert request.py_num_compressed_tokens > 0 and cache.capacity == prompt  # prompt pages stay (history)
    capacities = []
    for t in range(prompt, 60):
        step([t], context=False, last=False)
        capacities.append(cache.capacity)
    physical = logical - request.py_num_compressed_tokens
    assert physical == state.physical_length and cache.capacity == max(physical, prompt)
    assert max(capacities) < 60 and request.py_num_compressed_tokens == state.num_compressed_tokens > 0
    for layer, pool in enumerate(v2.pools):
        pages = torch.tensor(v2.pages[3])
        dense = pool[pages].permute(1, 2, 0, 3, 4).reshape(2, KV_HEADS, -1, DIM)[0, :, :physical, 0]
        assert torch.equal(dense.to(torch.int64), state.positions[layer])


def test_trtllm_manager_refuses_the_overlap_scheduler(stand_in_resource_manager):
    trtllm = stand_in_resource_manager
    from kvzap_export.errors import ConfigError

    manager = trtllm.compression_manager_class()(SimpleNamespace(algorithm="kvzap"), KVzapPolicy(0.0, window=WINDOW))
    manager.bind_kv_cache_managers(StandInKVCacheManagerV2())
    first, second = (SimpleNamespace(context_requests=[], context_requests_last_chunk=[], generation_requests=[])
                     for _ in range(2))
    manager.prepare_resources(first)
    manager.prepare_resources(second)  # the overlap scheduler prepares the next batch before updating this one
    with pytest.raises(ConfigError, match="disable_overlap_scheduler=True"):
        manager.update_resources(first)


def test_trtllm_finished_requests_are_skipped():
    from kvzap_export.integrations.trtllm import skip_request

    assert skip_request(SimpleNamespace(is_dummy=True))
    assert skip_request(SimpleNamespace(state=SimpleNamespace(name="GENERATION_COMPLETE")))
    assert not skip_request(SimpleNamespace(state=SimpleNamespace(name="GENERATION_IN_PROGRESS")))
    assert not skip_request(SimpleNamespace())
