"""Real hidden states for the checks: the post-input-RMSNorm activations of a real model on real text."""

from __future__ import annotations

import functools

import torch

HELD_OUT_TOPIC = "assert"  # a pydoc topic; validation text is not training text (training samples other topics)
MAX_TOKENS = 320


def resolve_model(manifest: dict, model: str | None) -> str | None:
    """``--model`` if given, else the bundle's preset when the toolkit can load that model offline."""
    if model is not None:
        return model
    from kvzap_export.presets import list_presets, load_preset

    name = manifest["model"]["preset"]
    if name in list_presets() and load_preset(name).model_source:
        return name
    return None


def held_out_text() -> str:
    from pydoc_data.topics import topics

    return topics[HELD_OUT_TOPIC] + "\n" + topics.get("with", "")


@functools.lru_cache(maxsize=2)
def _capture(model: str) -> dict[int, torch.Tensor]:
    from kvzap_export.llm import capture_hidden_states, load_llm

    llm, tokenizer = load_llm(model, dtype="float32")
    ids = tokenizer(held_out_text(), return_tensors="pt").input_ids[:, :MAX_TOKENS]
    with capture_hidden_states(llm) as captured, torch.no_grad():
        llm(input_ids=ids)
    return {layer: states[0].detach().clone() for layer, states in captured.items()}


def real_hidden_states(manifest: dict, model: str | None) -> dict[int, torch.Tensor] | None:
    """layer -> (num_tokens, hidden_size) float32, or None when no model can be loaded here."""
    target = resolve_model(manifest, model)
    if target is None:
        return None
    return _capture(target)
