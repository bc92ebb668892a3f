"""Shapes of the glue tests' small model and a stand-in of an engine's forward mode."""

from types import SimpleNamespace

LAYERS, KV_HEADS, HIDDEN, DIM = 3, 2, 16, 4
WINDOW = 6


def mode(extend: bool):
    return SimpleNamespace(is_extend=lambda: extend, is_decode=lambda: not extend)
