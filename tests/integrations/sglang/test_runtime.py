"""The SGLang runtime's logic where the real CPU engine cannot reach it, with a small stand-in of SGLang's
objects (slots, a ``req_to_token`` row, per-layer ``[slots, heads, dim]`` K/V buffers, an allocator).

Everything the engine can run is tested in the engine (test_engine.py and test_engine_streams.py: tokens vs kvpress, allocator
readings, refusals at launch). What stays here, and why:
- beam search and streaming sessions (requests sharing KV slots): not run in the CPU engine tests (time);
- a decode-first request reusing a row (a beam forked from its leader): not reachable without beam search;
- the flags of setups the CPU engine cannot launch (pipeline / attention-DP / decode context parallelism,
  disaggregation, unified memory, quantized KV cache): the mapping from setting to flag, a pure function;
- CUDA-graph capture of the scoring hook: GPU only;
- the masking math (native masked decode, flex masks, evict mode's physical rows) against per-head masked
  attention computed independently with SDPA.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvzap_export.integrations.core import KVzapPolicy
from kvzap_export.integrations.scoring import BundleScorer
from kvzap_export.integrations.sglang.masking import decode_block_masks, decode_view
from kvzap_export.kernels.ragged_attention import decode_attention
from kvzap_export.integrations.sglang.runtime import KVzapSGLang, request_choice
from kvzap_export.integrations.sglang.server_setup import ServerSetup
from tests.integrations.glue_shapes import DIM, HIDDEN, KV_HEADS, LAYERS, WINDOW, mode



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
                                   finished=lambda: self.done, rid="r0", sampling_params=None)
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
        self.req.kv.kv_allocated_len = self.req.kv.kv_committed_len = self.seq_len
        fb = SimpleNamespace(forward_mode=mode(extend), out_cache_loc=slots, req_pool_indices=torch.tensor([2]),
                             seq_lens=torch.tensor([self.seq_len]), positions=torch.arange(prefix, prefix + n),
                             extend_seq_lens=torch.tensor([n]) if extend else None,
                             extend_prefix_lens=torch.tensor([prefix]) if extend else None)
        runtime.shift_positions(fb)
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

    def held(self, layer: int) -> torch.Tensor:
        """Logical positions held per head: [H, seq_len]."""
        slots = self.req_to_token[2, : self.seq_len].to(torch.int64)
        return self.k[layer][slots, :, 0].T.to(torch.int64)


@pytest.mark.parametrize("sharing", ["beam_search", "streaming_session"])
def test_requests_sharing_kv_slots_are_left_alone(surrogate, sharing, caplog):
    """Beams read the prompt's slots; a streaming session's next turn reuses the cache by its logical length.
    Compacting either would corrupt another reader, so KVzap neither scores into a state nor evicts, and says
    so once per request; the session's next turn (prefix > 0, no state) is left alone too."""
    runtime = KVzapSGLang(BundleScorer(surrogate), KVzapPolicy(1e9, window=WINDOW), mode="evict")  # τ evicts all it may
    world = FakeSGLang()
    if sharing == "beam_search":
        world.req.beam_group = SimpleNamespace(leader=world.req)
    else:
        world.req.session = SimpleNamespace(streaming=True)
    free_before = len(world.free)
    hidden = torch.randn(30, HIDDEN, generator=torch.Generator().manual_seed(5))
    with caplog.at_level("WARNING", logger="kvzap_export.integrations.sglang.runtime"):
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


def test_a_row_reused_by_a_decode_request_does_not_inherit_offsets(surrogate):
    """A row freed after the last step end may hold a new request whose first forward is a decode (a beam
    forked from its leader): the positions hook forgets the finished owner before shifting."""
    runtime = KVzapSGLang(BundleScorer(surrogate), KVzapPolicy(1e9, window=WINDOW), mode="evict")
    world = FakeSGLang()
    world.forward(runtime, torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(6)), extend=True)
    assert int(runtime.offsets[2]) == 20 - WINDOW
    world.done = True  # finished in process_batch_result, after the step-end hook
    fb = SimpleNamespace(forward_mode=mode(False), positions=torch.tensor([9]), req_pool_indices=torch.tensor([2]),
                         extend_seq_lens=None, extend_prefix_lens=None)
    runtime.shift_positions(fb)
    assert fb.positions.tolist() == [9] and runtime.states == {} and int(runtime.offsets[2]) == 0


def test_request_choice_reads_custom_params():
    from kvzap_export.errors import InputError

    req = SimpleNamespace(sampling_params=SimpleNamespace(custom_params={"kvzap": "off"}))
    assert request_choice(req, "decoding") == "off"
    assert request_choice(SimpleNamespace(sampling_params=SimpleNamespace(custom_params=None)), "prefill") == "prefill"
    with pytest.raises(InputError, match="'sometimes'"):
        request_choice(SimpleNamespace(sampling_params=SimpleNamespace(custom_params={"kvzap": "sometimes"})), "off")


def good_setup(**changes):
    base = dict(radix_cache=False, page_size=1, speculative=False, mixed_chunk=False,
                unified_memory=False, dcp_size=1, pp_size=1, attn_dp_size=1, disaggregation="null",
                kv_dtype=torch.bfloat16, kv_quantized=False, kv_slots=4096, prefill_backend="kvzap_ragged",
                decode_backend="kvzap_ragged")
    return ServerSetup(**{**base, **changes})


ALL = ("evict", "mask", "ragged")


@pytest.mark.parametrize("change, modes, flag", [
    ({"radix_cache": True}, ALL, "--disable-radix-cache"),  # ragged mode: SGLang's own tree, not KVzap's
    ({"radix_cache": True, "radix_tree": "KVzapRaggedRadixCache"}, ("evict", "mask"), "--disable-radix-cache"),
    ({"speculative": True}, ALL, "--speculative-algorithm"),
    ({"pdmux": True}, ALL, "--enable-pdmux"),
    ({"two_batch_overlap": True}, ALL, "--enable-two-batch-overlap"),
    ({"unified_memory": True}, ALL, "--enable-unified-memory"),
    ({"dcp_size": 2}, ALL, "--dcp-size 1"),
    ({"pp_size": 2}, ALL, "--pp-size 1"),
    ({"attn_dp_size": 4}, ALL, "--attn-dp-size 1"),
    ({"disaggregation": "decode"}, ALL, "--disaggregation-mode"),
    ({"mixed_chunk": True}, ALL, "--enable-mixed-chunk"),
    ({"decode_graphs": True}, ("evict", "mask"), "--cuda-graph-backend-decode disabled"),
    ({"prefill_graphs": True}, ALL, "--cuda-graph-backend-prefill disabled"),
    ({"prefill_graphs": True, "decode_graphs": True}, ALL, "--cuda-graph-backend-prefill disabled"),
    ({"tp_size": 4, "kv_heads": 2}, ("ragged",), "--tp-size 2"),  # heads SGLang would replicate over ranks
    ({"page_size": 16}, ("evict", "ragged"), "--page-size 1"),
    ({"kv_dtype": torch.float8_e4m3fn}, ("evict", "mask", "ragged"), "--kv-cache-dtype auto"),
    ({"kv_quantized": True}, ("evict", "mask", "ragged"), "--kv-cache-dtype auto"),
])
def test_server_setup_names_the_flag_to_fix(surrogate, change, modes, flag):
    from kvzap_export.errors import ConfigError

    for m in ALL:
        assert good_setup().problems(m) == []
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


def test_tensor_parallelism_runs_in_every_mode_while_each_rank_holds_whole_kv_heads():
    for m in ALL:
        assert good_setup(tp_size=2, kv_heads=2).problems(m) == []
        assert good_setup(tp_size=4, kv_heads=8).problems(m) == []


def test_ragged_mode_runs_the_radix_cache_with_its_own_tree_only():
    (problem,) = good_setup(radix_cache=True, radix_tree="UnifiedRadixCache").problems("ragged")
    assert "another tree than KVzap's (UnifiedRadixCache" in problem and "--radix-cache-backend" in problem
    assert good_setup(radix_cache=True, radix_tree="KVzapRaggedRadixCache").problems("ragged") == []


def test_server_setup_names_the_attention_backend_a_mode_needs():
    setup = good_setup(prefill_backend="torch_native", decode_backend="torch_native")
    (problem,) = setup.problems("mask", ("kvzap_native", "kvzap_flex"))
    assert "decode attention backend is torch_native" in problem and "--attention-backend kvzap_native or kvzap_flex" in problem
    assert len(setup.problems("ragged", ("kvzap_ragged",), ("kvzap_ragged",))) == 2


def test_score_buffer_sized_for_the_pool_once_checked(surrogate):
    runtime = KVzapSGLang(BundleScorer(surrogate), KVzapPolicy(0.0, window=WINDOW), mode="evict")
    world = FakeSGLang()
    world.forward(runtime, torch.randn(5, HIDDEN), extend=True)
    assert runtime.slots.buffer.shape[1] == 1024  # grown on demand before the check
    runtime.check_setup(good_setup(kv_slots=5000))
    assert runtime.slots.buffer.shape == (LAYERS, 5000, KV_HEADS)
    world.forward(runtime, torch.randn(1, HIDDEN), extend=False)
    assert runtime.slots.buffer.shape == (LAYERS, 5000, KV_HEADS)


@pytest.mark.gpu
def test_scoring_refuses_cuda_graph_capture(surrogate):
    from kvzap_export.errors import ConfigError

    runtime = KVzapSGLang(BundleScorer(surrogate.cuda()), KVzapPolicy(0.0), mode="evict")
    fb = SimpleNamespace(out_cache_loc=torch.arange(1, 5, device="cuda"))
    hidden = torch.randn(4, HIDDEN, device="cuda")
    with pytest.raises(ConfigError, match="cuda-graph-backend"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            runtime.score(0, hidden, fb)


def per_head_reference(q, k, v, visible):
    """Per-head masked attention computed head by head (q: [q_heads, d]; k, v: [kv_heads, n, d])."""
    group = q.shape[0] // k.shape[0]
    out = torch.empty_like(q)
    for head in range(q.shape[0]):
        kv = head // group
        keys, values = k[kv][visible[kv]], v[kv][visible[kv]]
        weights = torch.softmax(keys @ q[head] / DIM ** 0.5, dim=0)
        out[head] = weights @ values
    return out


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kvzap_mode", ["mask", "evict"])
def test_masking_backends_attend_to_exactly_kvpress_set(surrogate, kvzap_mode):
    """Both decode paths (native: the batched decode attention with per-head masks; flex: a block mask) equal per-head attention
    over the entries kvpress keeps; in evict mode the cache rows are physical (uniform count, extras masked)."""
    from torch.nn.attention.flex_attention import flex_attention

    scorer = BundleScorer(surrogate)
    hidden = torch.randn(30, HIDDEN, generator=torch.Generator().manual_seed(1))
    layout = "ragged" if kvzap_mode == "mask" else "uniform"
    runtime = KVzapSGLang(scorer, KVzapPolicy(0.0, window=WINDOW, layout=layout), mode=kvzap_mode)
    world = FakeSGLang()
    world.forward(runtime, hidden, extend=True)
    state = runtime.states[2]
    kv_len = world.seq_len + 1  # this decode step's own token is in the cache too
    visible = runtime.visible(2, 1, kv_len)
    assert visible[:, -1].all() and not visible.all()  # something is masked at this threshold
    for h in range(KV_HEADS):  # the visible entries are exactly kvpress's kept positions, plus the new token
        if kvzap_mode == "mask":
            shown = torch.nonzero(visible[h, :-1]).flatten()
        else:
            shown = world.held(1)[h][visible[h, :-1]]
        assert shown.tolist() == state.kept_positions(1, h).tolist()
    g = torch.Generator().manual_seed(2)
    q_heads = 2 * KV_HEADS
    q = torch.randn(q_heads, DIM, generator=g)
    k, v = torch.randn(KV_HEADS, kv_len, DIM, generator=g), torch.randn(KV_HEADS, kv_len, DIM, generator=g)
    expected = per_head_reference(q, k, v, visible)
    slots = torch.arange(kv_len)
    # The native backend's path: SGLang's slot-major buffers seen as one-head entries, the step's masks
    # laid out for every layer at once (batch_visibility), one decode_attention call.
    req_to_token = torch.zeros(4, kv_len, dtype=torch.int32)
    req_to_token[2] = slots
    ids, lengths, batch_visible = decode_view(runtime, req_to_token, [2], [kv_len], KV_HEADS, "cpu")
    assert torch.equal(batch_visible[0, 1], visible)
    k_buffer, v_buffer = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()  # [slots, H, D]
    batched = decode_attention(q[None], k_buffer.view(-1, DIM), v_buffer.view(-1, DIM), ids, lengths, DIM ** -0.5,
                               visible=batch_visible[:, 1])[0]
    assert torch.allclose(batched, expected, atol=1e-5)
    layer = SimpleNamespace(layer_id=1, tp_q_head_num=q_heads, tp_k_head_num=KV_HEADS)
    fb = SimpleNamespace(req_pool_indices=torch.tensor([2]), seq_lens=torch.tensor([kv_len]))
    (mask,) = decode_block_masks(runtime, layer, fb, "cpu")
    flex = flex_attention(q[None, :, None], k[None], v[None], block_mask=mask, enable_gqa=True)[0, :, 0]
    assert torch.allclose(flex, expected, atol=1e-5)


@pytest.mark.parametrize("sglang_would_run", [True, False])
def test_ragged_mode_skips_sglangs_flashinfer_autotune_with_one_line_where_it_would_run(caplog, sglang_would_run):
    """Plumbing of the AROUND hook on ``should_run_flashinfer_autotune`` (ragged.register installs it): SGLang's own
    answer is asked with its arguments; where it says tune, ragged mode answers no and says why in one warning (the
    dummy forward has no ragged layout); elsewhere nothing is logged. SGLang answers yes only on CUDA with quantized or
    MoE models (SM 90+): that path has not run here."""
    import logging

    from kvzap_export.integrations.sglang.server_setup import autotune_hook

    asked = []

    def sglang(runner, *, for_speculative_draft=False):
        asked.append((runner, for_speculative_draft))
        return sglang_would_run

    with caplog.at_level(logging.WARNING, logger="kvzap_export"):
        assert autotune_hook(sglang, "runner", for_speculative_draft=True) is False
    assert asked == [("runner", True)]
    lines = [r.getMessage() for r in caplog.records if "autotune" in r.getMessage()]
    assert len(lines) == (1 if sglang_would_run else 0), lines
