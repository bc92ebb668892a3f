"""A transformers cache layer that physically holds a different number of entries per KV head.

After KVzap's compaction each head of each sequence keeps its own count; this layer stores exactly those
entries (one tensor per sequence and head), so the bytes it holds are the ragged layout's — what a paged
per-head engine holds. For attention it returns, per call, a padded ``[B, H, max_len, D]`` view written into a
workspace that all layers share, and publishes which slots are real (``valid``); attention must mask the rest.
Order inside a head does not matter to attention (RoPE was applied before caching), so new tokens
are simply appended to each head.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


_SCRATCH: dict[tuple, torch.Tensor] = {}


def _scratch(which: int, batch: int, heads: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """A contiguous ``[batch, heads, width, D]`` view of a flat workspace shared by every layer (one layer's
    attention runs at a time), grown on demand. Slots past a head's length hold zeros or stale finite
    K/V; attention masks them.
    """
    key = (which, like.dtype, like.device)
    need = batch * heads * width * like.shape[-1]
    buffer = _SCRATCH.get(key)
    if buffer is None or buffer.numel() < need:
        buffer = _SCRATCH[key] = like.new_zeros(max(need, 2 * (buffer.numel() if buffer is not None else 0)))
    return buffer[:need].view(batch, heads, width, like.shape[-1])


class RaggedHeadsLayer(DynamicLayer):
    """Cache layer with per-(sequence, head) K/V tensors of different lengths."""

    def __init__(self, keys: list[list[torch.Tensor]], values: list[list[torch.Tensor]]):
        super().__init__()
        self.head_keys, self.head_values = keys, values  # [sequence][head]: (len, head_dim)
        self.dtype, self.device = keys[0][0].dtype, keys[0][0].device
        self.is_initialized = True
        self.keys = self.values = None
        self.valid = self._valid()

    @classmethod
    def from_compacted(cls, keys: torch.Tensor, values: torch.Tensor, counts) -> RaggedHeadsLayer:
        """keys/values (B, H, T, D) with each head's kept entries first; counts (B, H)."""
        counts = [[int(c) for c in row] for row in counts]
        if len(counts) != keys.shape[0]:
            raise ValueError(f"counts for {len(counts)} sequences, K/V for {keys.shape[0]}")
        return cls([[keys[b, h, :c].clone() for h, c in enumerate(row)] for b, row in enumerate(counts)],
                   [[values[b, h, :c].clone() for h, c in enumerate(row)] for b, row in enumerate(counts)])

    def lengths(self) -> list[list[int]]:
        """[sequence][head]: entries held."""
        return [[k.shape[0] for k in heads] for heads in self.head_keys]

    def held_bytes(self, sequence: int | None = None) -> int:
        """Bytes of K and V this layer keeps between steps (of one sequence, or of all)."""
        rows = range(len(self.head_keys)) if sequence is None else (sequence,)
        return sum(t.numel() * t.element_size() for b in rows for t in (*self.head_keys[b], *self.head_values[b]))

    def _valid(self) -> torch.Tensor:
        lengths = torch.tensor(self.lengths())
        return torch.arange(int(lengths.max()))[None, None, :] < lengths[:, :, None]  # (B, H, max_len)

    def _padded(self, per_head: list[list[torch.Tensor]], which: int) -> torch.Tensor:
        width = max(t.shape[0] for heads in per_head for t in heads)
        out = _scratch(which, len(per_head), len(per_head[0]), width, per_head[0][0])
        for b, heads in enumerate(per_head):
            for h, t in enumerate(heads):
                out[b, h, : t.shape[0]] = t
        return out

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs=None):
        for b, (keys, values) in enumerate(zip(self.head_keys, self.head_values)):
            for h in range(len(keys)):
                keys[h] = torch.cat([keys[h], key_states[b, h]], dim=0)
                values[h] = torch.cat([values[h], value_states[b, h]], dim=0)
        self.valid = self._valid()
        return self._padded(self.head_keys, 0), self._padded(self.head_values, 1)

    def get_seq_length(self) -> int:
        return max(max(row) for row in self.lengths())
