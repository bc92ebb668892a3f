"""Row tables with a capacity per row: every (request slot, layer, KV head) row's entry ids in one flat buffer.

A ``RaggedStore`` row holds its (request, layer, head)'s entry ids in ascending logical positions. A dense
[slots, L, H, width] table would make every row as wide as the longest one held: one long request beside many short
ones, or heads that keep far fewer entries than others (70% pruned), and the table outgrows any fixed share of the KV
budget. Here each row has its own capacity instead:

- ``data`` int32 [size + 1]: the rows' columns, the last element a scratch cell (masked writes land there and
  padding reads read it: an entry id, 0);
- ``base`` int64 [slots, L, H] on the device (and its host copy): where each row's columns start; ``cap`` (host):
  how many it has. A row ``(s, l, h)``'s column ``c < cap`` is ``data[base[s, l, h] + c]``; readers clamp their
  indices to the buffer, so a column past a row's length reads some entry id, which lengths mask;
- ``reserve`` gives rows at least the columns asked for (a row that outgrows its capacity moves to a region of a
  quarter more, at the end of the used part). When the buffer is full, every live row is packed again, back to back,
  at a quarter more than it holds (``lengths``: the owner's figures, upper bounds are fine), so rows that decisions
  shrank give their columns back: the buffer then needs about 1.25 columns per entry held plus a rounding of
  ``MIN_COLUMNS`` per row, which the owner's reservation covers (``RaggedStore``: 2 columns per pool entry). Only
  if the rows still do not fit does the buffer grow (``grown`` counts the columns past its first size; logged);
- a released slot's rows give their regions up (``clear``); regions are reused when the rows are packed.

Everything a forward reads (``data``, ``base``) is read on the device; the host decides growth from its own copies
(``cap``, ``base_host``) and the store's mirrored lengths, with no device read.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

MIN_COLUMNS = 16  # a row's first capacity, and capacities are multiples of it


class RowTable:
    """The rows of ``slots`` request slots x ``layers`` x ``heads`` in one buffer of ``size`` columns (module
    docstring)."""

    def __init__(self, slots: int, layers: int, heads: int, size: int, device: torch.device, reserved: bool = False):
        self.layers, self.heads, self.device = layers, heads, torch.device(device)
        self.data = torch.zeros(max(size, 1) + 1, dtype=torch.int32, device=self.device)
        self.base = torch.zeros(slots, layers, heads, dtype=torch.int64, device=self.device)
        self.base_host = torch.zeros(slots, layers, heads, dtype=torch.int64)
        self.cap = torch.zeros(slots, layers, heads, dtype=torch.int64)
        self.used = 0  # columns below this one belong to a region (live or given up)
        self.grown = 0  # columns the buffer grew by past its first size (logged)
        self.relocated = self.packs = 0  # rows moved to a larger region; times every row was packed again
        self.reserved = reserved  # ``size`` is a reservation in a budget: growing past it is logged

    @property
    def size(self) -> int:
        return self.data.shape[0] - 1

    @property
    def scratch(self) -> int:
        return self.size

    def nbytes(self) -> int:
        """Bytes on the table's device (``data``, ``base``; the host copies are host memory)."""
        return self.data.numel() * self.data.element_size() + self.base.numel() * self.base.element_size()

    # ---- addressing --------------------------------------------------------------------------------
    def index(self, slots: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """int64 [B, L, H, W]: the buffer positions of columns ``columns`` ([W], or broadcastable to [B, L, H, W]) of
        every (layer, head) row of the slots ``slots`` (int64 [B], on the device); clamped to the scratch cell."""
        return (self.base[slots][..., None] + columns).clamp(max=self.scratch)

    def gather(self, slots: torch.Tensor, width: int) -> torch.Tensor:
        """int32 [B, L, H, width]: the first ``width`` columns of the slots' rows (past a row's capacity: padding)."""
        return self.data[self.index(slots, torch.arange(width, device=self.device))]

    def slot(self, slot: int, width: int) -> torch.Tensor:
        """int32 [L, H, width]: the first ``width`` columns of one slot's rows (no upload: the slot is a host int)."""
        return self.data[(self.base[slot][..., None] + torch.arange(width, device=self.device)).clamp(max=self.scratch)]

    def layer(self, slots: torch.Tensor, layer: int, width: int) -> torch.Tensor:
        """int32 [B, H, width]: one layer's first ``width`` columns of the slots' rows."""
        at = (self.base[slots, layer][..., None] + torch.arange(width, device=self.device)).clamp(max=self.scratch)
        return self.data[at]

    def write(self, slots: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
        """Columns ``0 ... W-1`` of the slots' rows := ``values`` [B, L, H, W] where ``valid`` (inside the rows'
        capacities: the caller's lengths); elsewhere nothing (the scratch cell)."""
        at = self.index(slots, torch.arange(values.shape[-1], device=self.device))
        self.data.index_put_((torch.where(valid, at, self.scratch),), values.to(torch.int32))

    # ---- capacity ----------------------------------------------------------------------------------
    def grow_slots(self, slots: int) -> None:
        have = self.cap.shape[0]
        if slots <= have:
            return
        L, H = self.layers, self.heads
        self.base = torch.cat([self.base, self.base.new_zeros(slots - have, L, H)])
        self.base_host = torch.cat([self.base_host, self.base_host.new_zeros(slots - have, L, H)])
        self.cap = torch.cat([self.cap, self.cap.new_zeros(slots - have, L, H)])

    def clear(self, slot: int) -> None:
        """The slot's rows give their regions up (packing reuses them)."""
        self.cap[slot] = 0

    def reserve(self, slots: torch.Tensor, need: torch.Tensor, upload, lengths: torch.Tensor) -> bool:
        """Every (layer, head) row of the host slots ``slots`` (int64 [B]) gets at least ``need`` [B, L, H] columns,
        its content kept. ``upload(*host_tensors)``: the owner's host -> device copy; ``lengths`` int64 [S, L, H] on
        the host: what every row holds (at most; packing sizes rows by it). Returns whether a row moved."""
        short = need > self.cap[slots]
        if not bool(short.any()):
            return False
        cap = self.cap[slots]
        new_cap = torch.where(short, _rounded(torch.maximum(need, cap + cap // 4)), cap)
        rows = short.nonzero()
        b, layer, head = rows.unbind(1)
        slot = slots[b]
        old_base, old_cap = self.base_host[slot, layer, head], self.cap[slot, layer, head]
        grow = new_cap[b, layer, head]
        if self.used + int(grow.sum()) > self.size:
            self._pack(slot, layer, head, grow, upload, lengths)
            return True
        start = self.used + torch.cumsum(grow, 0) - grow
        self.used += int(grow.sum())
        self.relocated += int(grow.shape[0])
        self._move(slot, layer, head, old_base, old_cap, start, upload)
        self.cap[slot, layer, head] = grow
        return True

    def _move(self, slot, layer, head, old_base, count, new_base, upload) -> None:
        """Copies ``count`` columns of each listed row from ``old_base`` to ``new_base`` and points the row there."""
        total = int(count.sum())
        if total:
            which = torch.repeat_interleave(torch.arange(count.shape[0]), count, output_size=total)
            offset = torch.arange(total) - torch.repeat_interleave(torch.cumsum(count, 0) - count, count, output_size=total)
            src, dst = upload(old_base[which] + offset, new_base[which] + offset)
            self.data[dst] = self.data[src]  # the right side is a copy: overlapping regions are safe
        self.base_host[slot, layer, head] = new_base
        (cells,) = upload((slot * self.layers + layer) * self.heads + head)
        self.base.view(-1)[cells] = upload(new_base)[0]

    def _pack(self, slot, layer, head, grow, upload, lengths) -> None:
        """Lays every live row out again, back to back, at a quarter more than it holds (the listed rows at least
        ``grow``), into a new buffer as large as the old one unless they need more (``grown`` then counts the
        difference). The old and the new buffer are held together for the copy."""
        S = self.cap.shape[0]
        held = lengths[:S]
        cap = torch.where(self.cap > 0, torch.minimum(self.cap, _rounded(held + held // 4)), 0)
        cap[slot, layer, head] = torch.maximum(grow, cap[slot, layer, head])
        live = cap.reshape(-1)
        total = int(live.sum())
        size = self.size if total <= self.size else int(total * 5 // 4)
        grew = size > self.size
        if grew:
            self.grown += size - self.size
        if grew and self.reserved:
            log.warning("ragged KV store: the row tables need %d columns, past the %d their reservation holds; the "
                        "buffer grows to %d", total, self.size, size)
        new_base = torch.cumsum(live, 0) - live
        keep = torch.minimum(self.cap, cap).reshape(-1)  # the columns each row keeps (at least what it holds)
        data = torch.zeros(size + 1, dtype=torch.int32, device=self.device)
        moved = int(keep.sum())
        if moved:
            which = torch.repeat_interleave(torch.arange(keep.shape[0]), keep, output_size=moved)
            offset = torch.arange(moved) - torch.repeat_interleave(torch.cumsum(keep, 0) - keep, keep, output_size=moved)
            src, dst = upload(self.base_host.reshape(-1)[which] + offset, new_base[which] + offset)
            data[dst] = self.data[src]
        self.data, self.used, self.cap = data, total, cap
        self.reserved = self.reserved and not grew  # logged once
        self.packs += 1
        self.base_host = new_base.view_as(self.base_host).clone()
        self.base = upload(self.base_host)[0].view_as(self.base_host).clone()


def _rounded(columns: torch.Tensor) -> torch.Tensor:
    return (columns.clamp(min=1) + MIN_COLUMNS - 1) // MIN_COLUMNS * MIN_COLUMNS
