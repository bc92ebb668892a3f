"""A transformers cache layer that physically holds a different number of entries per KV head.

After KVzap's compaction each head keeps its own count; this layer stores exactly those entries (one
tensor per head), so the bytes it holds are the ragged layout's — what a paged per-head engine holds.
For attention it returns, per call, a padded ``[1, H, max_len, D]`` view written into a workspace that
all layers share, and publishes which slots are real (``valid``); attention must mask the rest.
Order inside a head does not matter to attention (RoPE was applied before caching), so new tokens
are simply appended to each head.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


_SCRATCH: dict[tuple, torch.Tensor] = {}


def _scratch(which: int, heads: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """A contiguous ``[1, heads, width, D]`` view of a flat workspace shared by every layer (one layer's
    attention runs at a time), grown on demand. Slots past a head's length hold zeros or stale finite
    K/V; attention masks them.
    """
    key = (which, like.dtype, like.device)
    need = heads * width * like.shape[-1]
    buffer = _SCRATCH.get(key)
    if buffer is None or buffer.numel() < need:
        buffer = _SCRATCH[key] = like.new_zeros(max(need, 2 * (buffer.numel() if buffer is not None else 0)))
    return buffer[:need].view(1, heads, width, like.shape[-1])


class RaggedHeadsLayer(DynamicLayer):
    """Batch-1 cache layer with per-head K/V tensors of different lengths."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        super().__init__()
        self.head_keys, self.head_values = keys, values  # each (len_h, head_dim)
        self.dtype, self.device = keys[0].dtype, keys[0].device
        self.is_initialized = True
        self.keys = self.values = None
        self.valid = self._valid()

    @classmethod
    def from_compacted(cls, keys: torch.Tensor, values: torch.Tensor, counts) -> RaggedHeadsLayer:
        """keys/values (1, H, T, D) with each head's kept entries first; counts (H,)."""
        if keys.shape[0] != 1:
            raise ValueError("RaggedHeadsLayer holds one sequence (batch 1)")
        counts = [int(c) for c in counts]
        return cls([keys[0, h, :c].clone() for h, c in enumerate(counts)],
                   [values[0, h, :c].clone() for h, c in enumerate(counts)])

    def lengths(self) -> list[int]:
        return [k.shape[0] for k in self.head_keys]

    def held_bytes(self) -> int:
        """Bytes of K and V this layer keeps between steps."""
        return sum(t.numel() * t.element_size() for t in (*self.head_keys, *self.head_values))

    def _valid(self) -> torch.Tensor:
        lengths = torch.tensor(self.lengths())
        return torch.arange(int(lengths.max()))[None, :] < lengths[:, None]  # (H, max_len)

    def _padded(self, per_head: list[torch.Tensor], which: int) -> torch.Tensor:
        width = max(t.shape[0] for t in per_head)
        out = _scratch(which, len(per_head), width, per_head[0])
        for h, t in enumerate(per_head):
            out[0, h, : t.shape[0]] = t
        return out

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs=None):
        for h in range(len(self.head_keys)):
            self.head_keys[h] = torch.cat([self.head_keys[h], key_states[0, h]], dim=0)
            self.head_values[h] = torch.cat([self.head_values[h], value_states[0, h]], dim=0)
        self.valid = self._valid()
        return self._padded(self.head_keys, 0), self._padded(self.head_values, 1)

    def get_seq_length(self) -> int:
        return max(self.lengths())
