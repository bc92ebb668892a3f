"""Offline English text shared by validation, evaluation and training (no downloads).

Python's own documentation (``pydoc_data.topics``, about 465k characters). The topics at the end of
the sorted list, enough for :data:`RESERVED_TEXTS` texts of 3,000 characters (about 110k characters), are reserved for validation and evaluation
(:func:`held_out_texts`); training (``kvzap_export.train.sources``) reads only the others
(:func:`training_topics`), so the shipped surrogate never saw the text the parity checks run on.
"""

from __future__ import annotations

RESERVED_TEXTS, RESERVED_TEXT_CHARS = 8, 3000


def _reserved_keys() -> list[str]:
    """Topic keys from the end of the sorted list (reverse order) that make RESERVED_TEXTS texts."""
    from pydoc_data.topics import topics

    keys, texts, current = [], 0, 0
    for key in sorted(topics, reverse=True):
        if texts == RESERVED_TEXTS:
            break
        keys.append(key)
        current += len(topics[key].strip()) + 2
        if current >= RESERVED_TEXT_CHARS:
            texts, current = texts + 1, 0
    return keys


def _paragraphs(text: str, min_chars: int = 200) -> set[str]:
    return {" ".join(p.split()) for p in text.split("\n\n") if len(p) >= min_chars}


def training_topics() -> list[str]:
    """Every pydoc topic that validation does not reserve and that repeats none of a reserved topic's paragraphs
    (``compound`` holds the ``while``, ``try`` and ``with`` sections, for example), in sorted order."""
    from pydoc_data.topics import topics

    reserved = set(_reserved_keys())
    reserved_paragraphs = set().union(*(_paragraphs(topics[key]) for key in reserved))
    return [topics[key] for key in sorted(topics) if key not in reserved and not _paragraphs(topics[key]) & reserved_paragraphs]


def held_out_texts(count: int, min_chars: int = 3000) -> list[str]:
    """``count`` texts of at least ``min_chars`` characters from the reserved topics (reverse order)."""
    from pydoc_data.topics import topics

    texts, current = [], ""
    for key in _reserved_keys():
        current += topics[key].strip() + "\n\n"
        if len(current) >= min_chars:
            texts.append(current)
            current = ""
        if len(texts) == count:
            return texts
    raise ValueError(f"only {len(texts)} held-out texts of {min_chars} characters are reserved for validation "
                     f"(texts.RESERVED_TEXTS); ask for at most that many")
