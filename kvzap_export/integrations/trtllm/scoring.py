"""Scoring inside TensorRT-LLM's forward (engine-free): each attention layer's ``hidden_states`` through the
bundle's surrogate into a per-layer side buffer, with the forward's packing read from its attention metadata."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvzap_export.errors import ConfigError
from kvzap_export.integrations.scoring import BundleScorer, StepScores, check_hidden_states
from kvzap_export.integrations.trtllm import process


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
    if getattr(module, "rope_fusion", False) and process.STATE.get("evicts", False):
        raise ConfigError(f"attention layer {layer} fuses RoPE into the attention kernel (rope_fusion=True); KVzap's "
                          "physical eviction needs RoPE applied from position_ids: call install() before building the "
                          "model, or build its attention with rope_fusion disabled")


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    attention = process.engine_module("tensorrt_llm._torch.modules.attention").Attention
    return [m for m in model.modules() if isinstance(m, attention) and isinstance(getattr(m, "layer_idx", None), int)]


def kvzap_attention(base: type, scorer_fn=None) -> type:
    """A subclass of TensorRT-LLM's ``Attention`` (``base``) that records KVzap scores before attending.

    For models written for TensorRT-LLM: build the layers' attention from the returned class.
    ``scorer_fn()`` returns the process's ``KVzapScorer`` (default: the one ``install`` created).
    """
    get = scorer_fn or process.scorer

    class KVzapAttention(base):
        def forward(self, position_ids, hidden_states, attn_metadata, *args, **kwargs):
            _refuse_fused_rope(self.layer_idx, self)
            get().record(self.layer_idx, hidden_states, attn_metadata)
            return super().forward(position_ids, hidden_states, attn_metadata, *args, **kwargs)

    KVzapAttention.__name__ = KVzapAttention.__qualname__ = f"KVzap{base.__name__}"
    return KVzapAttention
