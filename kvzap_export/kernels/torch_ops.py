"""Torch custom ops ``kvzap::threshold_compaction`` and ``kvzap::kv_compaction``.

CUDA tensors run the Triton kernels; CPU tensors (or a machine without Triton) run the PyTorch
reference. Fake implementations give shapes/dtypes to ``torch.compile`` and meta tensors. Engine
integrations (TensorRT-LLM, SGLang) call these, so every engine shares one decision kernel.

    from kvzap_export.kernels.torch_ops import threshold_compaction, kv_compaction
"""

from __future__ import annotations

import torch

from kvzap_export.ops import compaction as reference
from kvzap_export.ops.compaction import Compaction


def _use_kernel(t: torch.Tensor) -> bool:
    if t.device.type != "cuda":
        return False
    from kvzap_export.kernels import triton_compaction

    return triton_compaction.triton is not None


@torch.library.custom_op("kvzap::threshold_compaction", mutates_args=())
def _threshold_compaction(scores: torch.Tensor, lengths: torch.Tensor, threshold: float, window: int,
                          sink: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _use_kernel(scores):
        from kvzap_export.kernels.triton_compaction import triton_threshold_compaction

        return tuple(triton_threshold_compaction(scores, lengths, threshold, window, sink))
    return tuple(reference.threshold_compaction(scores, lengths, threshold, window, sink))


@_threshold_compaction.register_fake
def _(scores, lengths, threshold, window, sink):
    batch, heads, seq = scores.shape
    return (scores.new_empty(batch, heads, seq, dtype=torch.bool), scores.new_empty(batch, heads, dtype=torch.int32),
            scores.new_empty(batch, heads, seq, dtype=torch.int32))


@torch.library.custom_op("kvzap::kv_compaction", mutates_args=())
def _kv_compaction(keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_kernel(keys):
        from kvzap_export.kernels.triton_compaction import triton_kv_compaction

        return triton_kv_compaction(keys, values, indices)
    return reference.kv_compaction(keys, values, indices)


@_kv_compaction.register_fake
def _(keys, values, indices):
    return torch.empty_like(keys), torch.empty_like(values)


def threshold_compaction(scores: torch.Tensor, lengths: torch.Tensor, threshold, window, sink=0) -> Compaction:
    """``kvzap_export.ops.threshold_compaction`` through the custom op (validated first, typed errors)."""
    tau, win, snk = reference.check_inputs(scores, lengths, threshold, window, sink)
    return Compaction(*torch.ops.kvzap.threshold_compaction(scores, lengths, tau, win, snk))


def kv_compaction(keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    reference.check_kv_inputs(keys, values, indices)
    return torch.ops.kvzap.kv_compaction(keys, values, indices)
