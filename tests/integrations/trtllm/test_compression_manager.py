"""The TensorRT-LLM glue's entry points on the CPU, against stand-ins of TensorRT-LLM's own modules (it cannot be
installed here): the KVzap compression config inside TensorRT-LLM's LLM arguments, and the resource manager
driven through the executor's flow."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvzap_export.integrations.core import KVzapPolicy
from kvzap_export.integrations.scoring import BundleScorer
from tests.integrations.glue_shapes import DIM, HIDDEN, KV_HEADS, LAYERS, WINDOW, attention_metadata

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
