"""The TensorRT-LLM glue's own logic on the CPU, with stand-ins shaped like the engine's objects (TensorRT-LLM
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
from tests.integrations.glue_shapes import DIM, HIDDEN, KV_HEADS, LAYERS, WINDOW



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
        assert torch.equal(dense[0].to(torch.int64), state.positions[layer][:, : length["physical"]])  # then -1 padding
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
        assert torch.equal(dense.to(torch.int64), state.positions[layer][:, :physical])  # past physical: -1 padding


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
