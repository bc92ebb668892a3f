"""kvzap-export's stand-in for ``IPython.display`` (not IPython): the two names SGLang 0.5.23 imports at start
(``sglang/utils.py:25``), used only to show HTML in notebooks. Both raise if used."""

from __future__ import annotations

_WHY = "is kvzap-export's import-time stand-in on the GPU machines: IPython is not installed there"


class HTML:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"IPython.display.HTML {_WHY}")


def display(*args, **kwargs):
    raise NotImplementedError(f"IPython.display.display {_WHY}")
