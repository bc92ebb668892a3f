"""Threshold compaction written from its specification (DESIGN.md, "Semantics of threshold compaction") in NumPy,
one (sequence, KV head) row at a time: the ONNX Runtime kernel of the plugin node.

It shares no code with ``kvzap_export.ops`` (the PyTorch reference, one vectorised pass over the batch), so the
plugin node's operator check compares two computations of the rule made independently:

    keep[b, h, t] = t < lengths[b] and (t >= lengths[b] - window or t < sink or not scores[b, h, t] < threshold)
    counts[b, h] = number of kept t;  indices[b, h, :counts] = the kept t ascending, then -1

The threshold is compared in the scores' dtype (as kvpress compares a Python float with its tensor); strict ``<``,
so a NaN score is kept.
"""

from __future__ import annotations

import numpy as np


def threshold_compaction_by_spec(scores, lengths, threshold, window: int, sink: int = 0):
    """scores [B, H, T] float; lengths [B] int; returns (keep bool, counts int32 [B, H], indices int32 [B, H, T])."""
    scores = np.asarray(scores)
    lengths = np.asarray(lengths)
    if scores.ndim != 3 or lengths.ndim != 1 or lengths.shape[0] != scores.shape[0]:
        raise ValueError(f"scores [batch, kv_heads, seq] and lengths [batch]; got {scores.shape} and {lengths.shape}")
    if int(window) < 0 or int(sink) < 0:
        raise ValueError(f"window and sink must be >= 0, got {window} and {sink}")
    batch, heads, seq = scores.shape
    tau = scores.dtype.type(threshold)
    keep = np.zeros(scores.shape, dtype=bool)
    counts = np.zeros((batch, heads), dtype=np.int32)
    indices = np.full(scores.shape, -1, dtype=np.int32)
    for b in range(batch):
        n = int(lengths[b])
        if not 0 <= n <= seq:
            raise ValueError(f"lengths[{b}] = {n} is outside [0, {seq}]")
        position = np.arange(n)
        protected = (position >= n - int(window)) | (position < int(sink))
        for h in range(heads):
            kept = np.flatnonzero(protected | ~(scores[b, h, :n] < tau))
            keep[b, h, kept] = True
            counts[b, h] = kept.size
            indices[b, h, : kept.size] = kept
    return keep, counts, indices
