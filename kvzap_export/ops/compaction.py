"""Threshold compaction: the PyTorch reference of KVzap's eviction decisions (DESIGN.md semantics).

For sequence b, KV head h, position t::

    keep[b,h,t] = t < lengths[b] and (t >= lengths[b] - window or t < sink or not scores[b,h,t] < threshold)

Strict ``<`` as kvpress, so a NaN score is kept; padding is never kept. The comparison happens in the
scores' dtype, exactly as kvpress's ``scores < threshold`` with a Python float (a bf16 model compares
against τ rounded to bf16).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from kvzap_export.errors import InputError

MAX_WINDOW = 1 << 24


class Compaction(NamedTuple):
    """keep bool [B, H, T]; counts int32 [B, H]; indices int32 [B, H, T] (kept positions ascending, then -1)."""

    keep: torch.Tensor
    counts: torch.Tensor
    indices: torch.Tensor


def _as_float(value, name: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise InputError(f"{name} must be a scalar, got a tensor of shape {list(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def _as_int(value, name: str) -> int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_floating_point():
            raise InputError(f"{name} must be an integer scalar, got {value.dtype} of shape {list(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{name} must be an integer, got {value!r}")
    return value


def check_inputs(scores, lengths, threshold, window, sink=0, *, check_lengths: bool = True) -> tuple[float, int, int]:
    """Validates the public op's inputs; returns (threshold, window, sink) as Python numbers.

    ``check_lengths=False`` skips the range check of ``lengths``' values, the one check that reads a tensor back
    to the host (on a GPU, a synchronization): for callers whose lengths are valid by construction.
    """
    if not isinstance(scores, torch.Tensor) or scores.dim() != 3:
        shape = list(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise InputError(f"scores must be a tensor [batch, kv_heads, seq], got {shape}")
    if not scores.is_floating_point():
        raise InputError(f"scores must be float16/bfloat16/float32, got {scores.dtype}")
    if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1:
        shape = list(lengths.shape) if isinstance(lengths, torch.Tensor) else type(lengths).__name__
        raise InputError(f"lengths must be a 1-D integer tensor [batch], got {shape}")
    if lengths.is_floating_point() or lengths.dtype == torch.bool:
        raise InputError(f"lengths must be an integer tensor, got {lengths.dtype}")
    if lengths.shape[0] != scores.shape[0]:
        raise InputError(f"lengths has batch {lengths.shape[0]} but scores has batch {scores.shape[0]}")
    if check_lengths and lengths.numel() and (int(lengths.min()) < 0 or int(lengths.max()) > scores.shape[2]):
        raise InputError(f"lengths must lie in [0, seq={scores.shape[2]}], got min {int(lengths.min())}, max {int(lengths.max())}")
    tau = _as_float(threshold, "threshold")
    if math.isnan(tau):
        raise InputError("threshold is NaN; pass a finite log-score such as -4")
    win = _as_int(window, "window")
    if not 0 <= win <= MAX_WINDOW:
        raise InputError(f"window must be in [0, {MAX_WINDOW}], got {win}")
    snk = _as_int(sink, "sink")
    if not 0 <= snk <= MAX_WINDOW:
        raise InputError(f"sink must be in [0, {MAX_WINDOW}], got {snk}")
    return tau, win, snk


def keep_mask(scores: torch.Tensor, lengths: torch.Tensor, threshold: float, window: int, sink: int = 0) -> torch.Tensor:
    """The decision rule alone (no validation): bool [B, H, T]."""
    seq = scores.shape[-1]
    pos = torch.arange(seq, device=scores.device)
    limit = lengths.to(device=scores.device, dtype=torch.int64)[:, None, None]
    valid = pos < limit
    protected = (pos >= limit - window) | (pos < sink)
    below = scores < threshold  # Python float: compared in the scores' dtype, as kvpress
    return valid & (protected | ~below)


def indices_from_keep(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """counts int32 [B, H] and indices int32 [B, H, T]: kept positions ascending, then -1."""
    seq = keep.shape[-1]
    pos = torch.arange(seq, device=keep.device)
    counts = keep.sum(dim=-1, dtype=torch.int32)
    # Kept positions sort before evicted ones, each group in position order.
    order = torch.argsort(torch.where(keep, pos, pos + seq), dim=-1)
    indices = torch.where(pos < counts[..., None], order, -1).to(torch.int32)
    return counts, indices


def threshold_compaction(scores: torch.Tensor, lengths: torch.Tensor, threshold, window, sink=0) -> Compaction:
    """KVzap's eviction decisions for a padded batch.

    scores: (batch, kv_heads, seq) float; lengths: (batch,) int, valid tokens per sequence;
    threshold: τ (float); window: most recent valid tokens always kept; sink: first tokens always kept.
    """
    tau, win, snk = check_inputs(scores, lengths, threshold, window, sink)
    keep = keep_mask(scores, lengths, tau, win, snk)
    counts, indices = indices_from_keep(keep)
    return Compaction(keep, counts, indices)


def recompact(stored_scores: torch.Tensor, physical_lengths: torch.Tensor, threshold, window, sink=0) -> Compaction:
    """Decode phase: re-apply the rule to an already-compacted cache with its stored scores.

    Equivalent to kvpress's ``decoding=True`` (each token tested once, when it leaves the window):
    kept entries stay kept (they were protected or not below τ), the last ``window`` logical tokens
    are still the last ``window`` physical entries, so only tokens that just left the window and
    score below τ are evicted. ``sink`` counts physical entries, which equal the first logical ones.
    stored_scores: (batch, kv_heads, physical_seq); physical_lengths: (batch,).
    """
    return threshold_compaction(stored_scores, physical_lengths, threshold, window, sink)


def check_kv_inputs(keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> None:
    """Validates the K/V move's inputs (shared by the reference and the kernels)."""
    if keys.dim() != 4 or values.shape != keys.shape:
        raise InputError(f"keys and values must both be [batch, kv_heads, seq, head_dim], got {list(keys.shape)} and {list(values.shape)}")
    if indices.shape != keys.shape[:3]:
        raise InputError(f"indices must be [batch, kv_heads, seq] = {list(keys.shape[:3])}, got {list(indices.shape)}")
    if indices.is_floating_point():
        raise InputError(f"indices must be integers, got {indices.dtype}")


def kv_compaction(keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Moves each head's kept entries to the front in order; the tail is zero.

    keys, values: (batch, kv_heads, seq, head_dim); indices: (batch, kv_heads, seq) int, -1 = none.
    """
    check_kv_inputs(keys, values, indices)
    valid = indices >= 0
    gather = torch.where(valid, indices, 0).to(torch.int64)[..., None].expand_as(keys)
    mask = valid[..., None]
    zero = torch.zeros((), dtype=keys.dtype, device=keys.device)
    return (torch.where(mask, torch.gather(keys, 2, gather), zero),
            torch.where(mask, torch.gather(values, 2, gather), zero))
