"""Training prompts cut from the offline text of kvzap_export.texts (pydoc topics, standard-library sources).

Texts are cut into prompts of 750-1250 tokens (deterministic in the seed). Prompt ``i`` is held out
for evaluation when ``i % HOLDOUT_EVERY == 0``.
"""

from __future__ import annotations

import random

from kvzap_export.errors import InputError
from kvzap_export.texts import corpus

HOLDOUT_EVERY = 8
MIN_TOKENS, MAX_TOKENS = 750, 1250


def make_prompts(tokenizer, num_prompts: int, seed: int = 0, docs: list[str] | None = None) -> list[str]:
    """Cuts the documents' token stream into ``num_prompts`` texts of 750-1250 tokens."""
    docs = corpus() if docs is None else docs
    text = "\n\n".join(d.strip() for d in docs if d.strip())
    if not text:
        raise InputError("training text is empty; give documents with some text in them")
    ids = tokenizer(text, add_special_tokens=False).input_ids
    rng = random.Random(seed)
    prompts, start = [], 0
    while len(prompts) < num_prompts and start + MIN_TOKENS <= len(ids):
        length = rng.randint(MIN_TOKENS, MAX_TOKENS)
        prompts.append(tokenizer.decode(ids[start : start + length]))
        start += length
    if not prompts:
        raise InputError(f"training text has {len(ids)} tokens, fewer than one prompt of {MIN_TOKENS}; give more text")
    return prompts


def is_held_out(index: int) -> bool:
    return index % HOLDOUT_EVERY == 0
