"""The K/V-move check runs in the bundle's dtype, and kvpress's cache bytes are measured from kvpress's own cache."""

from __future__ import annotations

import torch

from kvzap_export.validate.compaction_checks import _reference_kv
from kvzap_export.validate.reference import cache_bytes


def test_the_kv_move_reference_runs_in_the_bundles_dtype():
    """In a bfloat16 bundle the reference moves bfloat16 K/V (it used to move the float32 feed as is)."""
    keys = torch.randn(1, 2, 5, 4).to(torch.bfloat16).float()  # how bfloat16 feeds travel: float32 holding bf16 values
    indices = torch.tensor([[[0, 2, -1, -1, -1], [4, -1, -1, -1, -1]]], dtype=torch.int32)
    moved_keys, moved_values = _reference_kv("bfloat16")(keys, keys * 2, indices)
    assert moved_keys.dtype == moved_values.dtype == torch.bfloat16
    assert torch.equal(moved_keys[0, 0, :2].float(), keys[0, 0, [0, 2]]) and not moved_keys[0, 1, 1:].any()
    assert _reference_kv("float32")(keys, keys, indices)[0].dtype == torch.float32


def test_cache_bytes_are_read_from_the_cache_tensors():
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer in range(3):
        cache.update(torch.zeros(2, 4, 7, 8, dtype=torch.bfloat16), torch.zeros(2, 4, 7, 8, dtype=torch.bfloat16), layer)
    assert cache_bytes(cache, 2) == [3 * 2 * 4 * 7 * 8 * 2] * 2  # layers x (K, V) x heads x tokens x dim x 2 bytes
