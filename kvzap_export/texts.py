"""Offline English text shared by training, evaluation and validation (no downloads).

Python's own documentation (``pydoc_data.topics``, about 465k characters) and a few standard-library
sources. Training cuts prompts from the start of :func:`corpus`; evaluation and validation take
:func:`held_out_texts` from the end of the pydoc topics, which default-sized training runs do not reach.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

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


def held_out_texts(count: int, min_chars: int = 3000) -> list[str]:
    """``count`` texts of at least ``min_chars`` characters from the end of the pydoc topics (reverse order)."""
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
