"""Scoring inside serving engines: the bundle's surrogate as torch, and where a forward's scores wait for the step end.

- ``BundleScorer``: the bundle's surrogate for one tensor-parallel rank (``tp_head_range``), with kvpress's
  numerics (weights cast to the activation dtype, then applied);
- ``check_hidden_states``: a quantized attention input is refused in one line;
- ``StepScores`` (TensorRT-LLM: a forward's scores per layer) and ``SlotScores`` (SGLang's mask and evict modes:
  scores indexed by KV slot).

The decisions themselves live in ``core`` (``RequestState``); the SGLang ragged mode keeps scores beside its
entries (``ragged_store``).
"""

from __future__ import annotations

import copy

import torch

from kvzap_export.errors import ConfigError, InputError


def tp_head_range(total_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The KV heads one tensor-parallel rank holds: a contiguous block, or one replicated head when
    there are fewer KV heads than ranks (the split Llama-style models use in both engines)."""
    if tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tensor-parallel rank {tp_rank} outside [0, {tp_size})")
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise ConfigError(f"{total_kv_heads} KV heads do not split over {tp_size} ranks")
        per = total_kv_heads // tp_size
        return tp_rank * per, (tp_rank + 1) * per
    if tp_size % total_kv_heads:
        raise ConfigError(f"{tp_size} ranks cannot replicate {total_kv_heads} KV heads evenly")
    head = tp_rank // (tp_size // total_kv_heads)
    return head, head + 1


UNQUANTIZED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_hidden_states(hidden_states, where: str) -> None:
    """KVzap scores the unquantized attention input; a quantized one (FP8 / NVFP4 input quantization fused
    into the norm) is refused in one line. ``is_floating_point()`` alone would let float8 through."""
    kind = str(hidden_states.dtype) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dtype not in UNQUANTIZED_DTYPES:
        raise ConfigError(f"{where}: the attention input is {kind}, not float16/bfloat16/float32; KVzap scores the "
                          "unquantized hidden states (turn off quantized attention input, e.g. FP8 or NVFP4)")


class BundleScorer:
    """The bundle's surrogate as torch, for one tensor-parallel rank.

    ``score(layer, hidden_states)``: (..., hidden) -> (..., local KV heads), in hidden_states' dtype, with
    kvpress's numerics (weights cast to the activation dtype, then applied; the cast is cached).
    """

    def __init__(self, surrogate, heads: tuple[int, int] | None = None):
        self.surrogate = surrogate.eval()
        cfg = surrogate.config
        self.num_layers, self.total_kv_heads = cfg.n_modules, cfg.output_dim
        self.heads = heads or (0, cfg.output_dim)
        self.num_kv_heads = self.heads[1] - self.heads[0]
        self._layers: dict[tuple, object] = {}  # (layer, dtype, device) -> the cast layer, callable

    @classmethod
    def from_bundle(cls, bundle, tp_size: int = 1, tp_rank: int = 0) -> "BundleScorer":
        from pathlib import Path

        from kvzap_export.bundle.manifest import read_manifest
        from kvzap_export.surrogate.loader import load_surrogate

        manifest = read_manifest(bundle)
        surrogate = load_surrogate(Path(bundle) / manifest["surrogate"].get("path", "surrogate"))
        return cls(surrogate, tp_head_range(surrogate.config.output_dim, tp_size, tp_rank))

    def score(self, layer: int, hidden_states: torch.Tensor) -> torch.Tensor:
        key = (layer, hidden_states.dtype, hidden_states.device)
        run = self._layers.get(key)
        if run is None:  # the layer cast to the activation's dtype and device, once (it runs every layer and step)
            run = self._layers[key] = _direct(copy.deepcopy(self.surrogate.layers[layer]).to(
                device=hidden_states.device, dtype=hidden_states.dtype).requires_grad_(False))
        with torch.no_grad():
            out = run(hidden_states)
        return out[..., self.heads[0]: self.heads[1]]


def _direct(module: torch.nn.Module):
    """The surrogate layer as the functional calls its modules make (``F.linear``, exact ``F.gelu``): the same
    arithmetic without the module-call overhead, which at a decode step costs more than the layer's math."""
    import torch.nn.functional as F

    if isinstance(module, torch.nn.Linear):
        return lambda x: F.linear(x, module.weight, module.bias)
    parts = list(module) if isinstance(module, torch.nn.Sequential) else []
    if (len(parts) == 3 and isinstance(parts[0], torch.nn.Linear) and isinstance(parts[1], torch.nn.GELU)
            and parts[1].approximate == "none" and isinstance(parts[2], torch.nn.Linear)):
        first, second = parts[0], parts[2]
        return lambda x: F.linear(F.gelu(F.linear(x, first.weight, first.bias)), second.weight, second.bias)
    return module


class StepScores:
    """Per-layer side buffer for one forward pass: the scores of the tokens that forward fed.

    Engines that pack a step's tokens in one flat batch (TensorRT-LLM) write ``[num_tokens, H]`` per layer;
    the step-end hook splits them per request.
    """

    def __init__(self, num_layers: int):
        self.layers: list[torch.Tensor | None] = [None] * num_layers

    def write(self, layer: int, scores: torch.Tensor) -> None:
        self.layers[layer] = scores

    def take(self) -> list[torch.Tensor]:
        missing = [i for i, s in enumerate(self.layers) if s is None]
        if missing:
            raise InputError(f"no scores recorded for layers {missing[:5]}; is the scorer attached to every attention layer?")
        out, self.layers = self.layers, [None] * len(self.layers)
        return out


class SlotScores:
    """Slot-indexed side buffer: scores [L, num_slots, H] written at each token's KV slot.

    SGLang addresses KV by slot id (one slot holds every layer and head of a token); the scoring hook
    writes the new tokens' scores at ``out_cache_loc``, the step-end hook reads them by slot.
    """

    def __init__(self, num_layers: int, num_kv_heads: int):
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.buffer: torch.Tensor | None = None

    def ensure(self, num_slots: int, dtype: torch.dtype, device) -> None:
        buf = self.buffer
        if buf is not None and buf.shape[1] >= num_slots and buf.dtype == dtype and buf.device == torch.device(device):
            return
        size = max(num_slots, 2 * (buf.shape[1] if buf is not None else 0), 1024)
        new = torch.zeros(self.num_layers, size, self.num_kv_heads, dtype=dtype, device=device)
        if buf is not None and buf.dtype == dtype:
            new[:, : buf.shape[1]] = buf.to(device)
        self.buffer = new

    def write(self, layer: int, slots: torch.Tensor, scores: torch.Tensor) -> None:
        """slots: int [n]; scores: [n, H]."""
        self.buffer[layer].index_copy_(0, slots.to(torch.int64), scores.to(self.buffer.dtype))

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """slots: int [n] -> scores [L, H, n] (the layout ``RequestState`` takes)."""
        return self.buffer.index_select(1, slots.to(torch.int64)).transpose(1, 2)
