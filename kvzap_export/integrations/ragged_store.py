"""Per-head KV storage: one-head entries in one pool, a row of entry ids per (request, layer, KV head).

Engine-independent (pure torch). The SGLang ragged mode (``integrations/sglang/ragged.py``) keeps its
requests' K/V here; the design is in docs/ragged-kv.md.

- ``k``, ``v``: ``[capacity, head_dim]``; one entry = one token of one KV head of one layer.
- a free list (stack of entry ids; ``available`` is O(1));
- per request row, a ``RowTable``: ``ids int64 [L, H, cap]``, ``positions int64 [L, H, cap]`` (logical
  positions, ascending per row), ``lengths int64 [L, H]``, ``logical`` (tokens appended so far).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvzap_export.errors import InputError


class StoreFull(RuntimeError):
    """More entries were asked for than the pool has free (the engine's admission control let it through)."""


@dataclass
class RowTable:
    ids: torch.Tensor  # int64 [L, H, cap]
    positions: torch.Tensor  # int64 [L, H, cap]
    lengths: torch.Tensor  # int64 [L, H]
    logical: int = 0

    def held(self) -> int:
        return int(self.lengths.sum())


class RaggedStore:
    """The pool and the request rows. ``rows`` is keyed by the engine's request row id."""

    def __init__(self, capacity: int, num_layers: int, num_kv_heads: int, head_dim: int, v_head_dim: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if capacity <= 0 or num_layers <= 0 or num_kv_heads <= 0 or head_dim <= 0:
            raise InputError(f"RaggedStore needs positive sizes, got capacity={capacity}, layers={num_layers}, "
                             f"kv_heads={num_kv_heads}, head_dim={head_dim}")
        self.capacity, self.num_layers, self.num_kv_heads = capacity, num_layers, num_kv_heads
        self.k = torch.zeros(capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(capacity, v_head_dim or head_dim, dtype=dtype, device=device)
        self._free = torch.arange(capacity - 1, -1, -1, dtype=torch.int64, device=device)  # top of stack = end
        self._top = capacity
        self.rows: dict[int, RowTable] = {}

    # ---- the pool ------------------------------------------------------------------------------
    @property
    def available(self) -> int:
        """Free entries."""
        return self._top

    @property
    def held(self) -> int:
        """Entries handed out (read from the free list, not from the rows)."""
        return self.capacity - self._top

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def _take(self, n: int) -> torch.Tensor:
        if n > self._top:
            raise StoreFull(f"ragged KV store: {n} entries asked, {self._top} free of {self.capacity}")
        self._top -= n
        return self._free[self._top: self._top + n].clone()

    def _give(self, ids: torch.Tensor) -> None:
        n = ids.numel()
        if self._top + n > self.capacity:
            raise RuntimeError(f"ragged KV store: freeing {n} entries would exceed the capacity {self.capacity}")
        self._free[self._top: self._top + n] = ids.reshape(-1).to(self._free.device)
        self._top += n

    # ---- rows ------------------------------------------------------------------------------------
    def row(self, row: int) -> RowTable:
        table = self.rows.get(row)
        if table is None:
            raise InputError(f"ragged KV store: request row {row} holds nothing")
        return table

    def append(self, row: int, n: int) -> torch.Tensor:
        """Gives row ``row`` one new entry per (layer, head) for each of ``n`` new tokens; returns their ids
        ``[L, H, n]`` (at the end of every (layer, head) row, logical positions ``logical ... logical+n-1``)."""
        L, H = self.num_layers, self.num_kv_heads
        ids = self._take(L * H * n).view(L, H, n)
        table = self.rows.get(row)
        device = self._free.device
        if table is None:
            cap = max(n, 16)
            table = self.rows[row] = RowTable(torch.full((L, H, cap), -1, dtype=torch.int64, device=device),
                                              torch.full((L, H, cap), -1, dtype=torch.int64, device=device),
                                              torch.zeros(L, H, dtype=torch.int64, device=device))
        width = int(table.lengths.max()) + n
        if width > table.ids.shape[-1]:
            grow = max(width, 2 * table.ids.shape[-1]) - table.ids.shape[-1]
            table.ids = torch.cat([table.ids, table.ids.new_full((L, H, grow), -1)], -1)
            table.positions = torch.cat([table.positions, table.positions.new_full((L, H, grow), -1)], -1)
        at = table.lengths[..., None] + torch.arange(n, device=device)  # [L, H, n]
        table.ids.scatter_(-1, at, ids)
        logical = torch.arange(table.logical, table.logical + n, device=device).expand(L, H, n)
        table.positions.scatter_(-1, at, logical.contiguous())
        table.lengths += n
        table.logical += n
        return ids

    def last(self, row: int, layer: int, n: int) -> torch.Tensor:
        """The ids of the last ``n`` entries of every head of one layer: ``[H, n]`` (this forward's tokens)."""
        table = self.row(row)
        at = table.lengths[layer][:, None] - n + torch.arange(n, device=table.ids.device)
        return table.ids[layer].gather(-1, at)

    def compact(self, row: int, indices: torch.Tensor, counts: torch.Tensor) -> int:
        """Keeps, per (layer, head), the entries ``indices[l, h, :counts[l, h]]`` (indices into the row before
        this call, ascending) and frees the others; returns the number freed. indices: int [L, H, K] (-1
        padding); counts: int [L, H]."""
        table = self.row(row)
        L, H, width = table.ids.shape
        if indices.shape[:2] != (L, H) or counts.shape != (L, H):
            raise InputError(f"compact: indices {list(indices.shape)} / counts {list(counts.shape)} do not match "
                             f"[{L}, {H}, ...] rows")
        indices = indices.to(table.ids.device, torch.int64)
        counts = counts.to(table.ids.device, torch.int64)
        if bool((counts > table.lengths).any()):
            raise InputError("compact: a row keeps more entries than it holds")
        pos = torch.arange(width, device=table.ids.device)
        held = pos < table.lengths[..., None]
        k = indices.shape[-1]
        valid = torch.arange(k, device=indices.device) < counts[..., None]
        target = torch.where(valid, indices, width)  # padding lands in a spare column
        keep = torch.zeros(L, H, width + 1, dtype=torch.bool, device=held.device).scatter_(-1, target, True)[..., :width]
        evicted = table.ids[held & ~keep]
        gather = indices.clamp(min=0)
        new_ids = torch.where(valid, table.ids.gather(-1, gather), -1)
        new_pos = torch.where(valid, table.positions.gather(-1, gather), -1)
        table.ids = torch.cat([new_ids, new_ids.new_full((L, H, width - k), -1)], -1) if width > k else new_ids
        table.positions = torch.cat([new_pos, new_pos.new_full((L, H, width - k), -1)], -1) if width > k else new_pos
        table.lengths = counts.clone()
        self._give(evicted)
        return evicted.numel()

    def release(self, row: int) -> int:
        """Frees every entry of row ``row`` (the request left it); returns how many. A row that holds nothing
        is fine (a request that never ran a forward)."""
        table = self.rows.pop(row, None)
        if table is None:
            return 0
        pos = torch.arange(table.ids.shape[-1], device=table.ids.device)
        ids = table.ids[pos < table.lengths[..., None]]
        self._give(ids)
        return ids.numel()

    def clear(self) -> None:
        for row in list(self.rows):
            self.release(row)

    # ---- views -----------------------------------------------------------------------------------
    def gather(self, row: int, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer of one row: (ids [H, n], positions [H, n], lengths [H]) with n = the longest head; entries
        past a head's length are -1."""
        table = self.row(row)
        n = int(table.lengths[layer].max())
        return table.ids[layer, :, :n], table.positions[layer, :, :n], table.lengths[layer]
