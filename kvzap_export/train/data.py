"""Offline training text: Python's own documentation (pydoc_data.topics) and standard-library sources.

Texts are cut into prompts of 750-1250 tokens (deterministic in the seed). Prompt ``i`` is held out
for evaluation when ``i % HOLDOUT_EVERY == 0``.
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

from kvzap_export.errors import InputError

HOLDOUT_EVERY = 8
MIN_TOKENS, MAX_TOKENS = 750, 1250
STDLIB_MODULES = ("argparse.py", "collections/__init__.py", "dataclasses.py", "functools.py", "inspect.py", "json/decoder.py",
                  "pathlib.py", "random.py", "statistics.py", "string.py", "textwrap.py", "typing.py", "logging/__init__.py")


def corpus() -> list[str]:
    """Documents in a fixed order: every pydoc topic, then a few standard-library modules."""
    from pydoc_data.topics import topics

    docs = [topics[key] for key in sorted(topics)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in STDLIB_MODULES:
        path = stdlib / name
        if path.is_file():
            docs.append(path.read_text(errors="replace"))
    return docs


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


def held_out_texts(count: int, min_chars: int = 3000) -> list[str]:
    """Evaluation texts from the end of the corpus (pydoc topics in reverse order), which the
    training prompts (cut from the start of the corpus) do not reach for any default-sized run."""
    from pydoc_data.topics import topics

    texts, current = [], ""
    for key in sorted(topics, reverse=True):
        current += topics[key].strip() + "\n\n"
        if len(current) >= min_chars:
            texts.append(current)
            current = ""
        if len(texts) == count:
            break
    return texts
