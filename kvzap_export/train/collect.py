"""Resumable KVzip+ target collection: one safetensors file per prompt under ``DIR/targets/``.

Files are named by the prompt's domain and text digest, so a later run reuses every prompt it shares with an
earlier one, whatever their order (e.g. 144 prompts per domain after 48: where each source's share grows by a
whole factor, the larger run's evenly spaced picks include the smaller run's).

A file records the digest of its prompt's text and how positions were chosen; a file that does not
match the prompt it is asked for (another corpus, another setting) or that an interrupted run cut
short is computed again.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from kvzap_export.train.data import Prompt


def _cached(path: Path, meta: dict[str, str]) -> bool:
    from safetensors import safe_open

    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            stored = f.metadata() or {}
            if all(stored.get(k) == v for k, v in meta.items()) and {"features", "targets"} <= set(f.keys()):
                return True
    except Exception:  # noqa: BLE001 - a file cut short: recompute it
        pass
    path.unlink()
    return False


def _claim(directory: Path, model_id: str | None) -> None:
    """A cache holds one model's targets: ``cache.json`` names it; another model's cache is refused."""
    import json

    from kvzap_export.errors import ConfigError

    if model_id is None:
        return
    record = directory / "cache.json"
    if record.is_file():
        held = json.loads(record.read_text()).get("model")
        if held != model_id:
            raise ConfigError(f"--cache-dir {directory.parent}: it holds KVzip+ targets of another model ({held}); "
                              f"give another cache folder")
    else:  # a new cache (or one made before caches named their model, adopted)
        record.write_text(json.dumps({"model": model_id}) + "\n")


def collect_targets(model, tokenizer, out: Path, prompts: list[Prompt], positions_per_prompt: int = 0, seed: int = 0,
                    on_prompt: Callable[[Prompt, bool], None] | None = None, model_id: str | None = None) -> list[tuple[Prompt, Path]]:
    """Computes (or reuses) features/targets for each prompt; returns (prompt, file) pairs.

    Each file holds ``features`` (n, L, D) float16 and ``targets`` (n, L, H_kv) float32. Training prompts
    keep ``positions_per_prompt`` random token positions (0: all); evaluation prompts keep them all.
    """
    from safetensors.torch import save_file

    from kvzap_export.interrupts import check
    from kvzap_export.train.targets import layer_targets

    directory = out / "targets"
    directory.mkdir(parents=True, exist_ok=True)
    _claim(directory, model_id)
    done = []
    for prompt in prompts:
        check()
        path = directory / f"{prompt.key}.safetensors"
        keep = 0 if prompt.test else positions_per_prompt
        meta = {"sha256": prompt.digest, "positions": str(keep), "domain": prompt.domain}
        if keep:
            meta["seed"] = str(seed)  # which positions were drawn
        if _cached(path, meta):
            done.append((prompt, path))
            if on_prompt:
                on_prompt(prompt, True)
            continue
        features, targets = layer_targets(model, tokenizer, prompt.text)
        if keep and keep < features.shape[0]:
            gen = torch.Generator().manual_seed(seed * 100_003 + int(prompt.digest[:12], 16))
            chosen = torch.randperm(features.shape[0], generator=gen)[:keep].sort().values
            features, targets = features[chosen], targets[chosen]
        tmp = path.with_suffix(".tmp")
        save_file({"features": features.to(torch.float16).contiguous(), "targets": targets.float().contiguous()}, str(tmp),
                  metadata=meta)
        tmp.rename(path)
        done.append((prompt, path))
        if on_prompt:
            on_prompt(prompt, False)
    return done
