"""kvpress ``DMSPress`` decisions, re-derived from its documented algorithm (notes/kvpress.md), for tests.

Per layer: a score buffer is reset on prefill and appended on decode (when ``decoding``); once it holds
more than ``window`` scores, the oldest ``len - window`` leave it and each one below τ is masked
(strict ``<``), at absolute position ``seen - n_leaving - window + i``. Decisions are permanent.
"""

from __future__ import annotations

import torch


def kvpress_masked(steps: list[torch.Tensor], threshold: float, window: int, decoding: bool) -> torch.Tensor:
    """steps: score tensors [L, H, n] per forward (the first is the prefill). Returns masked bool [L, H, total]."""
    L, H, _ = steps[0].shape
    total = sum(s.shape[-1] for s in steps)
    masked = torch.zeros(L, H, total, dtype=torch.bool)
    buffer, seen = None, 0
    for i, new in enumerate(steps):
        seen += new.shape[-1]
        if i > 0 and not decoding:
            continue
        buffer = new if i == 0 else torch.cat([buffer, new], dim=-1)
        if buffer.shape[-1] > window:
            n = buffer.shape[-1] - window
            leaving, buffer = buffer[..., :n], buffer[..., n:]
            start = seen - n - window
            masked[..., start: start + n] |= leaving < threshold
    return masked
