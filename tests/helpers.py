"""Test helpers: synthetic kvpress-format checkpoints with a preset's exact shapes; counting host reads; a word tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvzap_export.presets import Preset
from kvzap_export.surrogate.model import Surrogate, SurrogateConfig


SMALL_PRESET = "name: small\nhidden_size: 64\nnum_layers: 3\nnum_attention_heads: 4\nnum_kv_heads: 2\nhead_dim: 16\n"


def preset_with_checkpoint(root: Path, text: str = SMALL_PRESET, variant: str = "mlp") -> tuple[Path, Path]:
    """A preset file written from ``text`` into ``root`` and a synthetic checkpoint for it: (preset, weights)."""
    from kvzap_export.presets import load_preset

    name = text.split("\n", 1)[0].removeprefix("name:").strip()
    preset = root / f"{name}.yaml"
    preset.write_text(text)
    return preset, synthetic_checkpoint(load_preset(str(preset)), variant, root / "w")


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


class HostReads(TorchDispatchMode):
    """Counts reads of one tensor value back to the host (``int(t)``, ``float(t)``, ``bool(t)``, ``t.item()``).

    On a GPU each is a synchronization with the device; the ops dispatched are the same on the CPU, so the count
    is too. (``t.tolist()`` and ``t.cpu()`` are not counted.)
    """

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


class WordTokenizer:
    """One token per whitespace-separated word; decode joins with spaces (enough for cutting prompts)."""

    def __call__(self, text, add_special_tokens=False):
        return type("Enc", (), {"input_ids": text.split()})()

    def decode(self, ids):
        return " ".join(ids)
