"""The KVzap surrogate as a plain torch module, in kvpress's checkpoint format.

kvpress's ``KVzapModel`` holds ``layers``: one ``nn.Linear(D, H_kv)`` (linear variant) or
``nn.Sequential(nn.Linear(D, hidden), nn.GELU(), nn.Linear(hidden, H_kv))`` (MLP variant) per
decoder layer. We rebuild the same modules so state-dict keys (``layers.{l}.weight`` or
``layers.{l}.0.weight`` ...) and numerics match, without depending on transformers.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass(frozen=True)
class SurrogateConfig:
    """kvpress ``KVzapConfig`` fields: ``hidden_dim=None`` means the linear variant."""

    input_dim: int
    output_dim: int
    n_modules: int
    hidden_dim: int | None = None

    @property
    def variant(self) -> str:
        return "linear" if self.hidden_dim is None else "mlp"

    def to_json_dict(self) -> dict:
        # The keys kvpress's KVzapConfig reads, plus what PreTrainedModel.from_pretrained expects.
        return {"architectures": ["KVzapModel"], "model_type": "kvzap", **asdict(self), "torch_dtype": "float32"}


def expected_state_shapes(cfg: SurrogateConfig) -> dict[str, tuple[int, ...]]:
    """State-dict key -> shape for a kvpress checkpoint with this config."""
    shapes: dict[str, tuple[int, ...]] = {}
    for layer in range(cfg.n_modules):
        if cfg.hidden_dim is None:
            shapes[f"layers.{layer}.weight"] = (cfg.output_dim, cfg.input_dim)
            shapes[f"layers.{layer}.bias"] = (cfg.output_dim,)
        else:
            shapes[f"layers.{layer}.0.weight"] = (cfg.hidden_dim, cfg.input_dim)
            shapes[f"layers.{layer}.0.bias"] = (cfg.hidden_dim,)
            shapes[f"layers.{layer}.2.weight"] = (cfg.output_dim, cfg.hidden_dim)
            shapes[f"layers.{layer}.2.bias"] = (cfg.output_dim,)
    return shapes


def make_layer(cfg: SurrogateConfig) -> nn.Module:
    """One layer's scorer: hidden_states (..., input_dim) -> scores (..., output_dim)."""
    if cfg.hidden_dim is None:
        return nn.Linear(cfg.input_dim, cfg.output_dim)
    # Exact (erf) GELU, as kvpress.
    return nn.Sequential(nn.Linear(cfg.input_dim, cfg.hidden_dim), nn.GELU(), nn.Linear(cfg.hidden_dim, cfg.output_dim))


class Surrogate(nn.Module):
    """All layers' scorers. ``layers[l](hidden_states)``: (num_tokens, D) -> (num_tokens, H_kv)."""

    def __init__(self, cfg: SurrogateConfig):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(make_layer(cfg) for _ in range(cfg.n_modules))

    def score(self, layer: int, hidden_states: torch.Tensor) -> torch.Tensor:
        """kvpress semantics: the layer's weights are cast to the activation dtype, then applied.

        hidden_states: (..., input_dim) -> scores (..., output_dim), in hidden_states' dtype.
        """
        module = self.layers[layer]
        params = {k: v.to(hidden_states.dtype) for k, v in module.state_dict().items()}
        return torch.func.functional_call(module, params, (hidden_states,))

    def save(self, directory: Path) -> None:
        """Writes ``config.json`` + ``model.safetensors`` that kvpress's ``KVzapModel`` loads."""
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_NAME).write_text(json.dumps(self.config.to_json_dict(), indent=2, sort_keys=True) + "\n")
        state = {k: v.detach().to(torch.float32).contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
