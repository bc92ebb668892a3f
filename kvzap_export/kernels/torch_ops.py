"""Torch custom ops ``kvzap::threshold_compaction`` and ``kvzap::kv_compaction``.

CUDA tensors run the Triton kernels; CPU tensors (or a machine without Triton) run the PyTorch reference
(``kvzap_export.ops.compaction``). Fake implementations give shapes and dtypes to ``torch.compile`` and
meta tensors. Engine integrations (TensorRT-LLM, SGLang) call these, so every engine shares one kernel.

    from kvzap_export.kernels.torch_ops import threshold_compaction, kv_compaction

The public functions validate their inputs (typed ``InputError``) and then call the op. The ops themselves
(``torch.ops.kvzap.*``) never re-validate, on any device: validating ``lengths`` reads them back to the host,
which on a GPU synchronizes the stream and breaks CUDA-graph capture. ``threshold_compaction(...,
check_lengths=False)`` skips that one check for callers whose lengths are valid by construction (the engine
state, ``integrations/core.py``, once per step), so nothing on that path waits for the device. The kernels are
memory-safe for any lengths, window and sink, and out-of-range K/V indices read nothing.
"""

from __future__ import annotations

import torch

from kvzap_export.ops import compaction as reference
from kvzap_export.ops.compaction import Compaction


def _kernels(t: torch.Tensor):
    """The Triton kernel module when ``t`` lives on a CUDA device and triton is installed, else None."""
    if t.device.type != "cuda":
        return None
    from kvzap_export.kernels import triton_compaction

    return triton_compaction if triton_compaction.triton is not None else None


@torch.library.custom_op("kvzap::threshold_compaction", mutates_args=())
def _threshold_compaction(scores: torch.Tensor, lengths: torch.Tensor, threshold: float, window: int,
                          sink: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kernels = _kernels(scores)
    if kernels is not None:
        return tuple(kernels.launch_threshold_compaction(scores, lengths, threshold, window, sink))
    keep = reference.keep_mask(scores, lengths, threshold, window, sink)  # the reference's rule, unvalidated
    return (keep, *reference.indices_from_keep(keep))


@_threshold_compaction.register_fake
def _(scores, lengths, threshold, window, sink):
    batch, heads, seq = scores.shape
    return (scores.new_empty(batch, heads, seq, dtype=torch.bool), scores.new_empty(batch, heads, dtype=torch.int32),
            scores.new_empty(batch, heads, seq, dtype=torch.int32))


@torch.library.custom_op("kvzap::kv_compaction", mutates_args=())
def _kv_compaction(keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    kernels = _kernels(keys)
    if kernels is not None:
        return kernels.launch_kv_compaction(keys, values, indices)
    return reference.kv_compaction(keys, values, indices)


@_kv_compaction.register_fake
def _(keys, values, indices):
    return torch.empty_like(keys), torch.empty_like(values)


def threshold_compaction(scores: torch.Tensor, lengths: torch.Tensor, threshold, window, sink=0, *,
                         check_lengths: bool = True) -> Compaction:
    """``kvzap_export.ops.threshold_compaction`` through the custom op (validated first, typed errors).

    scores: (batch, kv_heads, seq) float; lengths: (batch,) int. Returns keep bool (batch, kv_heads, seq),
    counts int32 (batch, kv_heads), indices int32 (batch, kv_heads, seq). ``check_lengths=False``: lengths are
    known to lie in [0, seq] and are not read back to the host (no device synchronization).
    """
    tau, win, snk = reference.check_inputs(scores, lengths, threshold, window, sink, check_lengths=check_lengths)
    return Compaction(*torch.ops.kvzap.threshold_compaction(scores, lengths, tau, win, snk))


def kv_compaction(keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kvzap_export.ops.kv_compaction`` through the custom op.

    keys, values: (batch, kv_heads, seq, head_dim); indices: (batch, kv_heads, seq) int, -1 = none.
    """
    reference.check_kv_inputs(keys, values, indices)
    return torch.ops.kvzap.kv_compaction(keys, values, indices)
