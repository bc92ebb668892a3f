"""The kvpress reference a bundle carries: greedy continuations of kvpress's masked run.

kvpress's ``DMSPress(KVzapPress)`` with the bundle's own surrogate copy and pruning settings, run on the
real model with transformers (in the main environment: kvpress 0.5.5 caps transformers below 5.3), for each
prompt, both with ``decoding=False`` (prefill only) and ``decoding=True``. The model level stores it as
``report/reference.json``; the engine level (``engine_level.py``, which may run in an environment where
kvpress cannot be installed) compares a serving engine's greedy tokens with it, prompt ids for prompt ids.

Schema ``kvzap-export-reference/1``::

    {"schema", "what", "model", "dtype", "tools": {kvpress, transformers, torch},
     "press": {"class", "threshold", "sliding_window_size", "variant", "surrogate"},
     "max_new_tokens", "prompts": [{"source", "prompt_ids", "runs": [{"decoding": bool, "output_ids": [...]}]}]}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch

SCHEMA = "kvzap-export-reference/1"
PATH = Path("report") / "reference.json"


def kvpress_press(bundle: Path, manifest: dict, llm, decoding: bool):
    """kvpress's ``DMSPress(KVzapPress)`` with the bundle's surrogate copy and pruning settings."""
    from kvpress import DMSPress, KVzapPress
    from kvpress.presses.kvzap_press import KVzapModel

    scorer = KVzapPress(model_type=manifest["surrogate"]["variant"])
    scorer.kvzap_model = KVzapModel.from_pretrained(str(Path(bundle) / manifest["surrogate"].get("path", "surrogate")))
    scorer.kvzap_model_name = f"nvidia/KVzap-{scorer.model_type}-{llm.config.name_or_path.split('/')[-1]}"
    pruning = manifest["pruning"]
    return DMSPress(press=scorer, threshold=pruning["threshold"], sliding_window_size=pruning["window"], decoding=decoding)


class KvpressRun(NamedTuple):
    tokens: torch.Tensor  # (B, new_tokens)
    logits: torch.Tensor  # (B, new_tokens, vocab)
    masked: list[int]  # per sequence: K/V entries (layer × head × position) kvpress masked by the end of the run
    cache_bytes: list[int]  # per sequence: K/V bytes of the cache transformers held at the end, measured from its tensors


def cache_bytes(cache, batch: int) -> list[int]:
    """Per sequence: the bytes of a transformers cache's key and value tensors (every layer), read from the tensors."""
    total = [0] * batch
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            if tensor is not None and tensor.numel():
                for b in range(batch):
                    total[b] += tensor[b].numel() * tensor.element_size()
    return total


def generate_kvpress(llm, ids: torch.Tensor, bundle: Path, manifest: dict, new_tokens: int, decoding: bool = False,
                     on_token=None, press=None) -> KvpressRun:
    """kvpress's masked greedy run on a batch of equal-length prompts ``ids`` (B, T): tokens (B, new_tokens), logits
    (B, new_tokens, vocab), and how many entries it masked in each sequence (read from each attention module's
    ``masked_key_indices``, whose first row is the sequence, before they are cleared). ``on_token()`` after each
    forward. Prefill forwards use every core, decode steps one (``kvzap_export.threads``). ``press``: one made by
    ``kvpress_press`` for this ``decoding`` (made here when None); a run beside others gets one made beforehand in
    the caller's thread, because transformers' ``from_pretrained`` (which loads kvpress's surrogate) swaps
    process-wide state (torch's init functions, the default dtype) and is not safe to run in two threads at once."""
    from kvzap_export.threads import prefill_threads

    press = press if press is not None else kvpress_press(bundle, manifest, llm, decoding)
    counting = llm.register_forward_hook(lambda *_: on_token()) if on_token else None
    try:
        with press(llm), torch.no_grad(), prefill_threads(llm):
            out = llm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               do_sample=False, return_dict_in_generate=True, output_logits=True)
    finally:
        if counting is not None:
            counting.remove()
    masked = torch.zeros(ids.shape[0], dtype=torch.long)
    for layer in llm.model.layers:
        indices = getattr(layer.self_attn, "masked_key_indices", None)
        if indices is not None:
            masked += torch.bincount(indices[0], minlength=ids.shape[0])
        layer.self_attn.masked_key_indices = None
    return KvpressRun(out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1), masked.tolist(),
                      cache_bytes(out.past_key_values, ids.shape[0]))


def _tools() -> dict:
    import importlib.metadata as md

    return {name: md.version(name) for name in ("kvpress", "transformers", "torch")}


def model_label(model: str) -> str:
    """A preset name as is; a model directory by its name only (a bundle carries no builder's paths)."""
    from kvzap_export.presets import list_presets

    return model if model in list_presets() else Path(model).name


def new_reference(manifest: dict, model: str, dtype: str, new_tokens: int) -> dict:
    pruning = manifest["pruning"]
    return {"schema": SCHEMA, "what": "kvpress DMSPress(KVzapPress) greedy continuations (masked run, transformers)",
            "model": model_label(model), "dtype": dtype, "tools": _tools(),
            "press": {"class": "DMSPress(KVzapPress)", "threshold": pruning["threshold"],
                      "sliding_window_size": pruning["window"], "variant": manifest["surrogate"]["variant"],
                      "surrogate": manifest["surrogate"].get("path", "surrogate"),
                      "surrogate_sha256": manifest["surrogate"].get("sha256")},
            "max_new_tokens": new_tokens, "prompts": []}


def add_prompt(reference: dict, source: str, ids: torch.Tensor, runs: dict[bool, torch.Tensor]) -> None:
    """runs: decoding -> output tokens (1, new_tokens)."""
    reference["prompts"].append({"source": source, "prompt_ids": ids[0].tolist(),
                                 "runs": [{"decoding": d, "output_ids": t[0].tolist()} for d, t in sorted(runs.items())]})


def write_reference(bundle: Path, reference: dict) -> Path:
    path = Path(bundle) / PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(reference) + "\n")
    return path


def read_reference(bundle: Path) -> dict | None:
    """The stored reference, or None when the bundle has none (the model level did not run)."""
    path = Path(bundle) / PATH
    if not path.is_file():
        return None
    reference = json.loads(path.read_text())
    if reference.get("schema") != SCHEMA:
        return None
    return reference


def lookup(reference: dict | None, prompt_ids: list[int], decoding: bool, new_tokens: int) -> list[int] | None:
    """The reference's tokens for these exact prompt ids and decoding setting (first ``new_tokens``), or None."""
    if reference is None or new_tokens > reference["max_new_tokens"]:
        return None
    for prompt in reference["prompts"]:
        if prompt["prompt_ids"] == list(prompt_ids):
            for run in prompt["runs"]:
                if run["decoding"] == decoding:
                    return run["output_ids"][:new_tokens]
    return None
