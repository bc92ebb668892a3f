"""Hidden states for the checks: the attention block's input (post-input-RMSNorm activations).

Real: a real model on several held-out texts (``TEXTS`` × up to ``TOKENS_PER_TEXT`` tokens, about 2.4k in all).
Synthetic, when no model can be loaded here: sequences with the statistics of an RMSNorm output (see
:func:`synthetic_hidden_states`), labelled ``synthetic`` in the report.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

TEXTS = 4
TOKENS_PER_TEXT = 600  # 4 × 600 = 2,400 tokens per layer; with window 128, 1,888 of them can be evicted
OPERATOR_TOKENS = 320  # the real-states feed of the operator level (and the Polygraphy replay file)
SYNTHETIC_HOW = ("per token: z ~ N(mu, I) over the hidden channels, with per-channel means mu ~ N(0, 0.5^2) and 2 "
                 "outlier channels at 20x (massive activations), divided by its RMS, times a per-channel RMSNorm gain "
                 "g ~ LogNormal(0, 0.5^2); seeded per layer")


class HiddenStates(NamedTuple):
    """texts[i][layer]: (num_tokens, hidden_size) float32; source: 'real' (model named) or 'synthetic'."""

    texts: list[dict[int, torch.Tensor]]
    source: str
    description: str

    def operator_feed(self, layer: int) -> torch.Tensor | None:
        first = self.texts[0] if self.texts else {}
        return first[layer][:OPERATOR_TOKENS] if layer in first else None

    def tokens(self) -> int:
        return sum(next(iter(text.values())).shape[0] for text in self.texts if text)


def resolve_model(manifest: dict, model: str | None) -> str | None:
    """``--model`` if given, else the bundle's preset when the toolkit can load that model offline."""
    if model is not None:
        return model
    from kvzap_export.presets import list_presets, load_preset

    name = manifest["model"]["preset"]
    if name in list_presets() and load_preset(name).model_source:
        return name
    return None


class CapturedText(NamedTuple):
    """What the capture's forward computed for one held-out text, at every position."""

    ids: torch.Tensor  # (T,) token ids
    states: dict[int, torch.Tensor]  # layer -> (T, hidden): the attention input (the checks' hidden states)
    keys: tuple[torch.Tensor, ...]  # per layer: (kv_heads, T, head_dim), as the KV cache holds them
    values: tuple[torch.Tensor, ...]
    final: torch.Tensor | None  # (T, hidden): the final norm's output, what the LM head reads (None: not reusable)

    def prefix(self, tokens: int) -> CapturedText:
        """The first ``tokens`` positions: attention is causal, so a forward of those ids alone computes the same
        values, up to float rounding (for a model whose RoPE does not depend on the forward's length)."""
        return CapturedText(self.ids[:tokens], {layer: s[:tokens] for layer, s in self.states.items()},
                            tuple(k[:, :tokens] for k in self.keys), tuple(v[:, :tokens] for v in self.values),
                            None if self.final is None else self.final[:tokens])


_LATEST: dict[str, tuple[CapturedText, ...]] = {}  # model -> the capture its latest validation used (captured_prefix)


@functools.lru_cache(maxsize=2)
def _capture(model: str, texts: int, tokens: int) -> tuple[CapturedText, ...]:
    from transformers import DynamicCache

    from kvzap_export.llm import capture_final_hidden, capture_hidden_states, equal_length_batches, load_llm
    from kvzap_export.texts import held_out_texts
    from kvzap_export.threads import large_work_threads, torch_threads

    llm, tokenizer = load_llm(model, dtype="float32")
    prompts = [tokenizer(text, return_tensors="pt").input_ids[:, :tokens] for text in held_out_texts(texts)]
    out: list[CapturedText | None] = [None] * len(prompts)
    for batch in equal_length_batches([ids.shape[1] for ids in prompts]):  # texts of equal length: one forward
        ids = torch.cat([prompts[i] for i in batch])
        cache = DynamicCache()  # every position of every layer, as the model level's own prefill keeps them
        with capture_hidden_states(llm) as captured, capture_final_hidden(llm) as final, torch.no_grad(), \
                torch_threads(large_work_threads()):
            logits = llm(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits  # the last only
            # A prefix is reusable where the model's logits are its LM head on the final norm's output, nothing more
            # (no scaling or soft-capping), and the cache holds every position.
            reusable = (len(final) == 1 and torch.equal(llm.lm_head(final[0][:, -1:]), logits)
                        and all(layer.keys.shape[-2] == ids.shape[1] for layer in cache.layers))
        for row, index in enumerate(batch):
            out[index] = CapturedText(ids[row].clone(), {layer: states[row].clone() for layer, states in captured.items()},
                                      tuple(layer.keys[row].clone() for layer in cache.layers) if reusable else (),
                                      tuple(layer.values[row].clone() for layer in cache.layers) if reusable else (),
                                      final[0][row].clone() if reusable else None)
    return tuple(out)


def captured_prefix(model: str, ids: torch.Tensor) -> CapturedText | None:
    """If the latest real hidden states of ``model`` in this process (``real_hidden_states``) came from a text whose
    ids begin with ``ids`` (T,), what that forward computed for those T positions (``CapturedText.prefix``); else
    None (also for a model whose capture is not reusable, see ``_capture``). Nothing is computed here."""
    for text in _LATEST.get(model, ()):
        tokens = ids.shape[-1]
        if text.final is not None and text.ids.shape[0] >= tokens and torch.equal(text.ids[:tokens], ids):
            return text.prefix(tokens)
    return None


def real_hidden_states(model: str, texts: int = TEXTS, tokens: int = TOKENS_PER_TEXT) -> HiddenStates:
    _LATEST[model] = _capture(model, texts, tokens)
    captured = [text.states for text in _LATEST[model]]
    total = sum(next(iter(t.values())).shape[0] for t in captured)
    return HiddenStates(captured, "real", f"{model} on {len(captured)} held-out texts ({total} tokens)")


def synthetic_hidden_states(num_layers: int, hidden_size: int, texts: int = TEXTS, tokens: int = TOKENS_PER_TEXT,
                            seed: int = 0) -> HiddenStates:
    """RMSNorm-like activations (see ``SYNTHETIC_HOW``): unit RMS per token before the gain, channel-wise
    structure (means, gains, a few outliers) as real attention inputs have, seeded per layer."""
    out: list[dict[int, torch.Tensor]] = [{} for _ in range(texts)]
    for layer in range(num_layers):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + layer)
        mean = torch.randn(hidden_size, generator=gen) * 0.5
        gain = torch.exp(torch.randn(hidden_size, generator=gen) * 0.5)
        outliers = torch.randperm(hidden_size, generator=gen)[:2]
        for i in range(texts):
            z = torch.randn(tokens, hidden_size, generator=gen) + mean
            z[:, outliers] *= 20.0
            out[i][layer] = z / z.pow(2).mean(dim=-1, keepdim=True).sqrt() * gain
    return HiddenStates(out, "synthetic", f"synthetic RMSNorm-like states ({texts} sequences × {tokens} tokens): {SYNTHETIC_HOW}")


def hidden_states_for(manifest: dict, model: str | None) -> HiddenStates:
    """Real states from ``model`` (or the bundle's shipped model), else synthetic ones."""
    from kvzap_export.errors import MissingDependencyError

    target = resolve_model(manifest, model)
    why = "no local model for this preset (pass --model PATH to a HF model directory)"
    if target is not None:
        try:
            return real_hidden_states(target)
        except MissingDependencyError as exc:
            why = f"{target} cannot be loaded here ({exc})"
    m = manifest["model"]
    states = synthetic_hidden_states(m["num_layers"], m["hidden_size"])
    return states._replace(description=f"{states.description}; real states unavailable: {why}")
