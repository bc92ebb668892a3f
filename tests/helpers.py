"""Test helpers: synthetic kvpress-format checkpoints with a preset's exact shapes."""

from __future__ import annotations

from pathlib import Path

import torch

from kvzap_export.presets import Preset
from kvzap_export.surrogate.model import Surrogate, SurrogateConfig


def synthetic_checkpoint(preset: Preset, variant: str, directory: Path, seed: int = 0, scale: float = 1.0) -> Path:
    """Random weights in kvpress's checkpoint format (the real weights are not reachable here)."""
    torch.manual_seed(seed)
    hidden = preset.mlp_hidden_dim if variant == "mlp" else None
    surrogate = Surrogate(SurrogateConfig(preset.hidden_size, preset.num_kv_heads, preset.num_layers, hidden))
    if scale != 1.0:
        with torch.no_grad():
            for p in surrogate.parameters():
                p.mul_(scale)
    surrogate.save(directory)
    return directory
