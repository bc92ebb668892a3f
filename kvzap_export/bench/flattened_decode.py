"""Ragged decode attention through SGLang's decode kernel with a per-call layout (``FlattenedDecode``): the variant
``scripts/bench_ragged_decode.py`` compares with the engine's (``kernels/flattened_step.py``, every layer laid out once
before the forward). No engine path runs it.

``FlattenedDecode`` allocates every per-step buffer once, for at most ``max_batch`` requests of at most
``max_width`` entries per head, so that their data pointers never change (CUDA graphs); ``fill`` rewrites them in
place on the device from our padded ids [B, kv_heads, W] and lengths [B, kv_heads], with no host read and no
allocation of ours (torch ops with ``out=`` or in place), then ``attend`` runs ``kernels.flattened_attention.launch``:

- ``kv_indptr`` int32 [rows + 1]: the running sum of the lengths (each clamped to W);
- ``kv_indices`` int64 [max_rows * max_width]: the heads' ids concatenated, by one scatter that is a permutation of
  the step's R x W slots: column j of row s goes to ``kv_indptr[s] + j`` when j < length, a padding column to the
  tail past the step's total (``total + s * W + j - kv_indptr[s + 1]``), which the kernel never reads; no two slots
  write one place (a shared spare slot would serialise every padding write on one address). int32 ids are written
  into the low words of the int64 slots (little-endian; the high words are zero, and zeroed again once after a fill
  with int64 ids, whose padding may be negative);
- ``num_kv_splits`` int32 [rows]: ``"proportional"`` (default): ``ceil(length / chunk)`` clamped to
  [1, max_kv_splits], with ``chunk = max(min_chunk, ceil(total entries / target_programs))``, so the step's entries
  spread over about ``target_programs`` programs (default 32 per SM) and a short head gets few splits;
  ``"max"``: every row ``max_kv_splits`` (what notes/gpu-h100.md measured);
- ``attn_logits`` / ``attn_lse``: the kernel's partial results; ``out`` [rows, group, Dv] in the queries' dtype.

``flattened_decode_attention`` is the same for eager callers: an instance per (device, dtype, heads, dims), grown on
demand, and a fresh output tensor per call.
"""

from __future__ import annotations

import sys

import torch

from kvzap_export.errors import InputError
from kvzap_export.kernels import sglang_kernels
from kvzap_export.kernels.flattened_attention import launch
from kvzap_export.kernels.ragged_shapes import query_group

SPLIT_POLICIES = ("proportional", "max")


class FlattenedDecode:
    """Buffers and launch of SGLang's decode kernel over the flattened rows (module docstring).

    ``max_batch`` requests of ``kv_heads`` heads, ``group`` query heads per KV head, head dims ``head_dim`` /
    ``v_head_dim``, at most ``max_width`` entry columns per head; ``dtype``/``device`` of the queries and stores.
    ``kernels``: an ``sglang_kernels.SGLangKernels`` (default: ``sglang_kernels.load(kernel_path)``)."""

    def __init__(self, max_batch: int, kv_heads: int, group: int, head_dim: int, max_width: int, *,
                 v_head_dim: int | None = None, dtype: torch.dtype = torch.bfloat16, device="cuda",
                 max_kv_splits: int = 32, split_policy: str = "proportional", target_programs: int | None = None,
                 min_chunk: int = 64, kernels: sglang_kernels.SGLangKernels | None = None, kernel_path=None):
        if min(max_batch, kv_heads, group, head_dim, max_width, max_kv_splits, min_chunk) <= 0:
            raise InputError(f"FlattenedDecode needs positive sizes, got batch {max_batch}, kv_heads {kv_heads}, group "
                             f"{group}, head_dim {head_dim}, width {max_width}, splits {max_kv_splits}, chunk {min_chunk}")
        if split_policy not in SPLIT_POLICIES:
            raise InputError(f"FlattenedDecode: split_policy {split_policy!r}; choose one of {SPLIT_POLICIES}")
        rows, slots = max_batch * kv_heads, max_batch * kv_heads * max_width
        if slots >= 2**31 - 1:
            raise InputError(f"FlattenedDecode: {max_batch} x {kv_heads} x {max_width} entry slots do not fit the kernel's "
                             "int32 kv_indptr; use a smaller batch or width")
        if sys.byteorder != "little":  # pragma: no cover - every CUDA host is little-endian
            raise InputError("FlattenedDecode writes int32 ids into int64 slots: little-endian hosts only")
        self.kernels = kernels if kernels is not None else sglang_kernels.load(kernel_path)
        self.max_batch, self.kv_heads, self.group, self.max_width = max_batch, kv_heads, group, max_width
        self.head_dim, self.v_head_dim = head_dim, v_head_dim or head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.max_kv_splits, self.split_policy, self.min_chunk = max_kv_splits, split_policy, min_chunk
        if target_programs is None:
            cores = sglang_kernels.get_device_core_count(self.device.index or 0) if self.device.type == "cuda" else 0
            target_programs = 32 * cores if cores > 0 else 256
        self.target_programs = target_programs
        dev, i32, i64, f32 = self.device, torch.int32, torch.int64, torch.float32
        self.kv_indptr = torch.zeros(rows + 1, dtype=i32, device=dev)
        self.kv_indices = torch.zeros(slots, dtype=i64, device=dev)
        self._kv_low = self.kv_indices.view(i32)  # int32 ids go to the low words (even positions)
        self.num_kv_splits = torch.ones(rows, dtype=i32, device=dev)
        self.attn_logits = torch.zeros(rows, group, max_kv_splits, self.v_head_dim, dtype=f32, device=dev)
        self.attn_lse = torch.zeros(rows, group, max_kv_splits, dtype=f32, device=dev)
        self.out = torch.zeros(rows, group, self.v_head_dim, dtype=dtype, device=dev)
        self._q = torch.zeros(rows, group, head_dim, dtype=dtype, device=dev)  # queries that cannot be viewed
        self._lens = torch.zeros(rows, dtype=i32, device=dev)
        self._empty = torch.zeros(rows, dtype=torch.bool, device=dev)
        self._chunk = torch.zeros(1, dtype=i32, device=dev)
        self._columns = torch.arange(max_width, dtype=i64, device=dev)
        self._slot = torch.arange(slots, dtype=i64, device=dev)  # s * W + j of a step's [R, W] slots
        self._shift = torch.zeros(rows, dtype=i64, device=dev)  # per row: padding position - valid position formula
        self._dest = torch.zeros(slots, dtype=i64, device=dev)
        self._padding = torch.zeros(slots, dtype=torch.bool, device=dev)
        self._rows = 0
        self._high_words_dirty = False

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every tensor this instance allocated (their data pointers never change)."""
        return {"kv_indptr": self.kv_indptr, "kv_indices": self.kv_indices, "num_kv_splits": self.num_kv_splits,
                "attn_logits": self.attn_logits, "attn_lse": self.attn_lse, "out": self.out, "q": self._q,
                "lens": self._lens, "empty": self._empty, "chunk": self._chunk, "columns": self._columns,
                "slot": self._slot, "shift": self._shift, "dest": self._dest, "padding": self._padding}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers().values())

    def fits(self, batch: int, width: int) -> bool:
        return batch <= self.max_batch and width <= self.max_width

    # ---- per step, in place --------------------------------------------------------------------------------
    def fill(self, ids: torch.Tensor, lengths: torch.Tensor) -> None:
        """Lays out one step: ids int32/int64 [B, kv_heads, W] (padding: anything), lengths int [B, kv_heads] on the
        device (a length past W counts as W). Writes kv_indptr, kv_indices, num_kv_splits in place; reads nothing
        back to the host."""
        if ids.dim() != 3 or ids.shape[1] != self.kv_heads or lengths.shape != ids.shape[:2]:
            raise InputError(f"FlattenedDecode.fill: ids [B, {self.kv_heads}, W] and lengths [B, {self.kv_heads}], got "
                             f"{list(ids.shape)} and {list(lengths.shape)}")
        B, W = ids.shape[0], ids.shape[2]
        if not self.fits(B, W):
            raise InputError(f"FlattenedDecode.fill: batch {B} x width {W} past the buffers' {self.max_batch} x "
                             f"{self.max_width}")
        if ids.dtype not in (torch.int32, torch.int64):
            raise InputError(f"FlattenedDecode.fill: ids must be int32 or int64, got {ids.dtype}")
        R = B * self.kv_heads
        self._rows = R
        lens = self._lens[:R]
        lens.copy_(lengths.reshape(R))
        lens.clamp_(0, W)
        torch.cumsum(lens, 0, dtype=torch.int32, out=self.kv_indptr[1: R + 1])
        torch.eq(lens, 0, out=self._empty[:R])
        if W > 0:
            indptr, total = self.kv_indptr, self.kv_indptr[R: R + 1]
            dest, padding = self._dest[: R * W].view(R, W), self._padding[: R * W].view(R, W)
            columns = self._columns[:W]
            torch.add(indptr[:R, None], columns, out=dest)  # a held column: row start + column
            torch.ge(columns, lens[:, None], out=padding)
            # a padding column: total + s * W + j - indptr[s + 1] = the held formula + shift[s], with
            # shift[s] = total + s * W - indptr[s] - indptr[s + 1]
            shift = self._shift[:R]
            torch.sub(self._slot[: R * W: W], indptr[:R], out=shift)
            shift.sub_(indptr[1: R + 1]).add_(total)
            torch.addcmul(dest, padding, shift[:, None], out=dest)
            if ids.dtype == torch.int32:
                if self._high_words_dirty:  # an int64 fill wrote negative padding: its high words are not zero
                    self._kv_low[1::2].zero_()
                    self._high_words_dirty = False
                dest.mul_(2)
                self._kv_low.index_put_((dest,), ids.reshape(R, W))
            else:
                self.kv_indices.index_put_((dest,), ids.reshape(R, W))
                self._high_words_dirty = True
        splits = self.num_kv_splits[:R]
        if self.split_policy == "max":
            splits.fill_(self.max_kv_splits)
            return
        chunk = self._chunk
        torch.add(self.kv_indptr[R: R + 1], self.target_programs - 1, out=chunk)
        chunk.div_(self.target_programs, rounding_mode="floor").clamp_(min=self.min_chunk)
        torch.add(lens, chunk, out=splits)
        splits.sub_(1).div_(chunk, rounding_mode="floor").clamp_(1, self.max_kv_splits)

    def attend(self, q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, scale: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q [B, kv_heads * group, D] over the rows of the last ``fill`` (same B), K and V from the
        one-head stores [E, D] / [E, Dv] (rows contiguous; any row stride). Returns [B, q_heads, Dv]: ``out`` when
        given (contiguous, q's shape with Dv), else a view of this instance's ``out`` buffer (overwritten by the
        next call)."""
        R = self._rows
        return launch(self.kernels, q, k_store, v_store, scale, rows=R, kv_heads=self.kv_heads, group=self.group,
                      head_dim=self.head_dim, v_head_dim=self.v_head_dim, kv_indptr=self.kv_indptr[: R + 1],
                      kv_indices=self.kv_indices, num_kv_splits=self.num_kv_splits[:R], attn_logits=self.attn_logits,
                      attn_lse=self.attn_lse, empty=self._empty[:R], spare_q=self._q,
                      out=self.out[:R] if out is None else out)

    def __call__(self, q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, ids: torch.Tensor,
                 lengths: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """``fill`` then ``attend``."""
        self.fill(ids, lengths)
        return self.attend(q, k_store, v_store, scale, out)


_INSTANCES: dict[tuple, FlattenedDecode] = {}


def flattened_decode_attention(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, ids: torch.Tensor,
                               lengths: torch.Tensor, scale: float, *, kernel_path=None) -> torch.Tensor:
    """Eager ragged decode attention through SGLang's kernel: the contract of
    ``ragged_attention.ragged_decode_attention`` (q [B, q_heads, D]; stores [E, D] / [E, Dv]; ids int [B, kv_heads,
    W]; lengths int [B, kv_heads] on q's device). Returns a new [B, q_heads, Dv] tensor. Buffers are kept per
    (device, dtype, heads, dims) and grown (doubling) when a step is larger: not for CUDA-graph capture (use a
    ``FlattenedDecode`` sized once)."""
    group = query_group(q, k_store, v_store, ids)
    B, Hq, _ = q.shape
    H, W = ids.shape[1], ids.shape[2]
    out = torch.empty(B, Hq, v_store.shape[-1], dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    key = (q.device, q.dtype, H, group, q.shape[-1], v_store.shape[-1], None if kernel_path is None else str(kernel_path))
    inst = _INSTANCES.get(key)
    if inst is None or not inst.fits(B, W):
        grown = lambda need, have: have if need <= have else max(need, 2 * have)  # noqa: E731
        batch, width = (B, max(W, 1)) if inst is None else (grown(B, inst.max_batch), grown(W, inst.max_width))
        inst = FlattenedDecode(batch, H, group, q.shape[-1], width, v_head_dim=v_store.shape[-1], dtype=q.dtype,
                               device=q.device, kernel_path=kernel_path)
        _INSTANCES[key] = inst
    inst.fill(ids, lengths.to(q.device))
    return inst.attend(q, k_store, v_store, scale, out=out)
