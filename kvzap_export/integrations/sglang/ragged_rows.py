"""Ragged mode's host side of a forward (``ragged.py``'s docstring): SGLang's aux-cache protocol that lays each
step's entries out in the store before the forward (``StoreRows``), and the batch view the backend builds from host
bookkeeping (``Step``, ``build_step``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvzap_export.integrations.host_reads import counted
from kvzap_export.integrations.ragged_shared import SharedRaggedStore
from kvzap_export.integrations.ragged_store import RaggedStore


@dataclass
class Step:
    """One forward's batch, laid out once before it from host bookkeeping (nothing read back from the device).

    slots: int64 [B] the requests' table slots in the store; counts: new tokens per request (host) and
    ``count_tensor`` the same on the device; new_ids: int64 [L, H, T] this forward's entries, tokens in batch
    order; widths: per layer, the longest row (host); lengths: int32 [B, L, H]; fresh: no request held anything
    before (every extend of a new prompt); prefix_widths / prefix_agree: per layer, the longest held prefix and
    whether every head of each request holds as many (extend over held entries only); where: the tokens'
    positions in the padded extend layout (None when the prompts have one length); groups: per layer, the torch
    decode path's rows split by length (``ragged_attention.row_groups``; None: one padded call), CPU decode only.
    """

    rows: list[int]
    slots: torch.Tensor
    counts: list[int]
    count_tensor: torch.Tensor
    new_ids: torch.Tensor
    widths: list[int]
    lengths: torch.Tensor
    fresh: bool
    prefix_widths: list[int]
    prefix_agree: list[bool]
    where: torch.Tensor | None
    groups: list | None = None


class StoreRows:
    """SGLang's aux-cache protocol for ``ReqToTokenPool``: grows rows before each forward (host side, the whole
    batch at once), frees released rows. With the radix cache on, a new request's row first adopts its matched
    prefix's recorded entries (``SharedRaggedStore.adopt_all``; ``prefix_lens``: the extend batch's, in its order, set
    by a BEFORE hook on SGLang's ``alloc_for_extend``)."""

    def __init__(self, store: RaggedStore, dense_capacity: int, req_to_token: torch.Tensor | None = None):
        self.store, self.dense_capacity, self.req_to_token = store, dense_capacity, req_to_token
        self.plan: tuple[list[int], list[int], list[int], torch.Tensor] | None = None  # rows, counts, targets, ids
        self.prefix_lens: list[int] | None = None

    @counted("forward")
    def alloc_to_lengths(self, *, req_pool_indices_cpu, target_seq_lens_cpu) -> None:
        rows = [int(r) for r in req_pool_indices_cpu.tolist()]
        targets = [int(t) for t in target_seq_lens_cpu.tolist()]
        prefixes, self.prefix_lens = self.prefix_lens, None
        if prefixes is not None and isinstance(self.store, SharedRaggedStore):
            # the new requests whose prompts start with a cached prefix: one adoption (one read) for the batch
            self.store.adopt_all({r: self.req_to_token[r, :p] for r, p in zip(rows, prefixes)
                                  if p > 0 and r not in self.store.logical})
        if isinstance(self.store, SharedRaggedStore):  # the admitted requests adopted what admission set aside
            self.store.clear_aside()
        counts = [t - self.store.logical.get(r, 0) for r, t in zip(rows, targets)]
        if any(n < 0 for n in counts):  # SGLang's row is shorter than what the store holds for it: our bug
            raise RuntimeError(f"ragged store: rows {rows} hold more tokens than SGLang's lengths {targets}")
        grow = [(r, n) for r, n in zip(rows, counts) if n > 0]
        new = self.store.append([r for r, _ in grow], [n for _, n in grow])
        self.plan = (rows, counts, targets, new)

    def take_plan(self, seq_lens: list[int], padded: bool = False):
        """The rows, new counts and new entries of the forward about to run (laid out by ``alloc_to_lengths`` for
        it), once. ``seq_lens``: the forward's lengths (host); ``padded``: a replayed graph's batch, whose rows past
        the requests are SGLang's padding (only the first ``len(rows)`` are compared). A missing plan or other
        lengths is our bug."""
        plan, self.plan = self.plan, None
        if plan is not None and padded and len(seq_lens) >= len(plan[2]):
            seq_lens = seq_lens[: len(plan[2])]
        if plan is None or plan[2] != seq_lens:
            raise RuntimeError(f"ragged store: the forward's lengths {seq_lens} were not laid out before it "
                               f"({'no plan' if plan is None else plan[2]})")
        return plan[0], plan[1], plan[3]

    @counted("release")
    def free(self, row) -> None:
        self.store.release(int(row))

    def clear(self) -> None:
        self.store.clear()
        self.plan = None

    def reset_allocator(self) -> None:
        pass


def build_step(store: RaggedStore, rows: list[int], counts: list[int], new_ids: torch.Tensor, extend: bool) -> Step:
    """The batch view of one forward from host bookkeeping."""
    from kvzap_export.kernels.ragged_attention import layer_groups, token_positions

    groups = None
    if not extend and store.device.type == "cpu" and rows:  # the torch decode path: rows grouped by length
        held = store.lengths_host[store.slots_host(rows)]  # [B, L, H]: one read for every layer
        per_layer = held.transpose(0, 1).reshape(held.shape[1], -1).tolist()
        widths, groups = [max(lengths) for lengths in per_layer], layer_groups(per_layer, store.device)
    else:
        widths = store.widths(rows)
    slots = store.slots(rows)
    fresh = extend and all(store.logical.get(r, 0) == n for r, n in zip(rows, counts))
    prefix_widths, prefix_agree = [], []
    if extend and not fresh:
        held = store.lengths_host[store.slots_host(rows)] - torch.tensor(counts)[:, None, None]  # [B, L, H]
        prefix_widths = held.amax(dim=(0, 2)).tolist()
        prefix_agree = (held.amax(-1) == held.amin(-1)).all(0).tolist()
    return Step(rows, slots, counts, torch.tensor(counts, dtype=torch.int64).to(store.device), new_ids, widths,
                store.lengths[slots], fresh, prefix_widths, prefix_agree,
                token_positions(counts, store.device) if extend else None, groups)
