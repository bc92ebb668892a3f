"""Resumable KVzip+ target collection: one safetensors file per prompt under ``DIR/targets/``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from kvzap_export.train.data import is_held_out, make_prompts


def collect_targets(model, tokenizer, out: Path, num_prompts: int, positions_per_prompt: int = 500, seed: int = 0,
                    on_prompt: Callable[[int, bool], None] | None = None) -> list[Path]:
    """Computes (or reuses) features/targets for each prompt; returns the per-prompt files.

    Each file holds ``features`` (n, L, D) float16 and ``targets`` (n, L, H_kv) float32 for
    ``positions_per_prompt`` random token positions of the original text (all of them for held-out prompts).
    """
    from safetensors.torch import load_file, save_file

    from kvzap_export.train.targets import layer_targets

    directory = out / "targets"
    directory.mkdir(parents=True, exist_ok=True)
    prompts = make_prompts(tokenizer, num_prompts, seed)
    files = []
    for index, text in enumerate(prompts):
        path = directory / f"prompt_{index:04d}.safetensors"
        if path.is_file():
            try:
                load_file(str(path))
                files.append(path)
                if on_prompt:
                    on_prompt(index, True)
                continue
            except Exception:  # a file cut short by an interrupted run: recompute it
                path.unlink()
        features, targets = layer_targets(model, tokenizer, text)
        if not is_held_out(index) and positions_per_prompt < features.shape[0]:
            gen = torch.Generator().manual_seed(seed * 100_003 + index)
            chosen = torch.randperm(features.shape[0], generator=gen)[:positions_per_prompt].sort().values
            features, targets = features[chosen], targets[chosen]
        tmp = path.with_suffix(".tmp")
        save_file({"features": features.to(torch.float16).contiguous(), "targets": targets.float().contiguous()}, str(tmp))
        tmp.rename(path)
        files.append(path)
        if on_prompt:
            on_prompt(index, False)
    return files
