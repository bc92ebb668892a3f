"""Ragged decode through SGLang's decode kernel, in buffers allocated once: eager or replayed from a CUDA graph.

The ragged backend (``ragged.py``) runs a decode step this way on CUDA (``KVZAP_RAGGED_DECODE_KERNEL=sglang``, the
default there; the CPU keeps the torch path). Before the forward, outside any graph (SGLang calls the backend's
``init_forward_metadata_out_graph`` before each replay, ``init_forward_metadata`` on an eager step), ``layout``:

- uploads the step's table slots (one host -> device copy, pinned and non-blocking) into ``slots`` [max_batch];
- copies the step's new entry ids, which the aux cache took before the forward, into ``new_ids`` [L, H, max_batch];
- lays out every layer's flattened rows from the store's row tables (``kernels.flattened_step``).

Rows past the step's requests (SGLang pads a replayed batch to the captured size) hold nothing: slot -1, new ids
the store's ``scratch`` row, so their K/V and score writes land where nothing reads and their attention is zeros.
The forward itself (what a CUDA graph captures: each layer's K/V write, the scoring hook's score write, attention)
reads only these buffers and the store's K/V/scores, whose data pointers never change: the row tables may grow
(``RaggedStore._ensure``) between steps because only ``layout`` reads them (and, within its step, an eager step laid
out layer by layer: ``FlattenedStep``). Nothing reads the device back.

At capture (``capture_layout``) the batch is all padding: SGLang's capture batch is dummy rows (request row 0,
lengths 1) that the store does not hold.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvzap_export.errors import ConfigError, InputError
from kvzap_export.integrations.ragged_store import RaggedStore, upload

ENV = "KVZAP_RAGGED_DECODE_KERNEL"  # a debug and test switch: which kernel ragged decode attends with
KERNELS = ("sglang", "torch")
RENAMED = "KVZAP_RAGGED_DECODE"  # the switch's former name (values flattened | torch), refused in one line


def decode_kernel(device: torch.device) -> str:
    """``sglang`` (SGLang's decode kernel over these buffers, the step's rows flattened; the default on CUDA) or
    ``torch`` (the padded gather of ``kernels.ragged_attention`` in torch ops, no graphs; the default elsewhere).
    ``$KVZAP_RAGGED_DECODE_KERNEL`` overrides (tests run SGLang's kernel on the CPU engine, in Triton's interpreter)."""
    return chosen_kernel() or ("sglang" if device.type == "cuda" else "torch")


def graphs_allowed() -> bool:
    """Whether the decode kernel the environment asks for can run in CUDA graphs (the torch path cannot)."""
    return chosen_kernel() != "torch"


def chosen_kernel() -> str:
    """``$KVZAP_RAGGED_DECODE_KERNEL`` ("" when unset); a value not in ``KERNELS``, or the switch's former name still
    set, is a one-line ``ConfigError``."""
    renamed = os.environ.get(RENAMED, "").strip()
    if renamed:
        raise ConfigError(f"{RENAMED}={renamed!r} is no longer read: it is now {ENV}, with sglang for flattened "
                          f"(SGLang's decode kernel) and torch for torch; unset {RENAMED}")
    chosen = os.environ.get(ENV, "").strip().lower()
    if chosen and chosen not in KERNELS:
        raise ConfigError(f"{ENV}={chosen!r}: use one of {list(KERNELS)}")
    return chosen


@dataclass
class BufferedDecode:
    """What one decode forward reads besides the store: ``new_ids`` int64 [L, H, B] (a view of the buffers; B the
    step's padded batch). The scoring hook writes each layer's scores at ``new_ids[layer]``."""

    new_ids: torch.Tensor


def write_entries(store: RaggedStore, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """One layer's new K/V into the store: ids int64 [H, T] (the layer's new entries), k [T, H, D], v [T, H, Dv] in
    token order. One write each, graph-safe (no host read, ids from a fixed buffer or the step's plan)."""
    flat = ids.T.reshape(-1)  # [T * H] in (token, head) order
    store.k.index_copy_(0, flat, k.reshape(flat.shape[0], -1).to(store.k.dtype))
    store.v.index_copy_(0, flat, v.reshape(flat.shape[0], -1).to(store.v.dtype))


def buffer_bytes(layers: int, kv_heads: int, group: int, head_dim: int, v_head_dim: int, dtype: torch.dtype,
                 max_batch: int, logits_batch: int, max_kv_splits: int, small_batch_splits: int) -> int:
    """Bytes ``DecodeBuffers`` of these sizes allocate besides the step's ``kv_indices`` (one int64 per pool entry,
    which the KV budget counts per entry): ``ragged_budget`` sets them aside before SGLang sizes the pool."""
    from kvzap_export.kernels.flattened_step import step_bytes

    return (8 * layers * kv_heads * max_batch + 8 * max_batch
            + step_bytes(layers, max_batch, kv_heads, group, head_dim, v_head_dim, dtype, logits_batch, max_kv_splits,
                         small_batch_splits))


class DecodeBuffers:
    """A decode step's device state for at most ``max_batch`` requests (module docstring). ``group``: query heads per
    KV head; ``dtype``: the queries'. ``kernels`` / ``use_triton`` / ``max_kv_splits`` / ``logits_batch`` /
    ``small_batch_splits``: passed to ``FlattenedStep``."""

    def __init__(self, store: RaggedStore, max_batch: int, group: int, dtype: torch.dtype, *, kernels=None,
                 use_triton: bool | None = None, max_kv_splits: int = 32, logits_batch: int | None = None,
                 small_batch_splits: int | None = None):
        from kvzap_export.kernels.flattened_step import FlattenedStep

        if max_batch <= 0:
            raise InputError(f"DecodeBuffers: max_batch must be positive, got {max_batch}")
        L, H, dev = store.num_layers, store.num_kv_heads, store.device
        self.store, self.max_batch = store, max_batch
        self.new_ids = torch.full((L, H, max_batch), store.scratch, dtype=torch.int64, device=dev)
        self.slots = torch.full((max_batch,), -1, dtype=torch.int64, device=dev)
        self.flat = FlattenedStep(L, max_batch, H, group, store.head_dim, store.capacity, v_head_dim=store.v_head_dim,
                                  dtype=dtype, device=dev, kernels=kernels, use_triton=use_triton,
                                  max_kv_splits=max_kv_splits, logits_batch=logits_batch,
                                  small_batch_splits=small_batch_splits)

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every tensor a decode forward reads besides the store (their data pointers never change)."""
        return {"new_ids": self.new_ids, "slots": self.slots, **{f"flat.{k}": v for k, v in self.flat.buffers().items()}}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers().values())

    def extent(self, rows: list[int]) -> tuple[int, int, int]:
        """(the longest row, every entry id, the most entry ids of one layer) the rows ``rows`` hold over every layer
        and head, from the host mirror (upper bounds) in one read."""
        if not rows:
            return 0, 0, 0
        held = self.store.lengths_host[self.store.slots_host(rows)]  # [B, L, H]
        width, ids, layer_ids = torch.stack([held.max(), held.sum(), held.sum((0, 2)).max()]).tolist()
        return width, ids, layer_ids

    def fits_graph(self, rows: list[int]) -> bool:
        """Whether a decode step of ``rows`` fits the ids a CUDA graph reads (rows sharing a cached prefix may hold
        more ids than the pool has entries: such a step runs eagerly, ``graph_fits_hook``)."""
        return self.flat.fits(self.extent(rows)[1])

    def layout(self, rows: list[int], new_ids: torch.Tensor, batch: int | None = None,
               graphed: bool = False) -> BufferedDecode:
        """Lays out a decode step of the requests ``rows`` (the store's rows, in the forward's order; each appended one
        token: ``new_ids`` int64 [L, H, len(rows)]), padded to ``batch`` rows (default: no padding). ``graphed``: a CUDA
        graph's replay, which reads the ids laid out here only (an eager step past them is laid out layer by layer)."""
        n = len(rows)
        batch = n if batch is None else batch
        if not 0 < batch <= self.max_batch or n > batch:
            raise InputError(f"DecodeBuffers.layout: {n} requests padded to {batch}, the buffers hold 1 to "
                             f"{self.max_batch}")
        if new_ids.shape != (self.store.num_layers, self.store.num_kv_heads, n):
            raise InputError(f"DecodeBuffers.layout: new ids {list(new_ids.shape)} for {n} requests of one token each")
        slots = torch.full((batch,), -1, dtype=torch.int64)
        if n:
            slots[:n] = self.store.slots_host(rows)
        self.slots[:batch].copy_(upload(self.store.device, slots)[0])
        self.new_ids[:, :, :n].copy_(new_ids)
        self.new_ids[:, :, n:batch].fill_(self.store.scratch)
        width, ids, layer_ids = self.extent(rows)  # the torch copy pads to the longest row; the ids pick the layout
        if graphed and not self.flat.fits(ids):  # graph_fits_hook sends such a step to the eager path
            raise RuntimeError(f"KVzap ragged mode: a replayed decode step's rows hold up to {ids} entry ids, the "
                               f"graphs' buffer {self.flat.kv_indices.shape[0] - 1}")
        self.flat.fill(self.store.table, self.store.lengths, self.slots[:batch], width, ids, layer_ids)
        return BufferedDecode(self.new_ids[:, :, :batch])

    def capture_layout(self, batch: int) -> BufferedDecode:
        """A batch of ``batch`` padding rows (SGLang's capture batch)."""
        return self.layout([], self.new_ids[:, :, :0], batch, graphed=True)

    def attend(self, layer: int, q: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s attention of q [B, q_heads, D] (B: the laid-out batch) into ``out`` [B, q_heads, Dv]."""
        return self.flat.attend(layer, q, self.store.k, self.store.v, scale, out)


def graph_fits_hook(parts, result, runner, forward_batch, *args, **kwargs):
    """AFTER ``DecodeCudaGraphRunner.can_run_graph`` (``parts``: the process's ``RaggedParts``, bound at registration):
    a ragged decode step whose rows hold more entry ids than a graph's fixed buffer (requests sharing a cached prefix
    each list its entries) runs eagerly instead (the backend's ``decode_fits_graph``, which says so once). The backend
    comes from ``parts``, not the runner: SGLang may hand the runner a wrapper of it."""
    fits = getattr(parts.backend, "decode_fits_graph", None)
    return False if result and fits is not None and not fits() else None
