"""The threshold-compaction op (PyTorch reference) and the engine formats derived from it."""

from kvzap_export.ops.compaction import Compaction, keep_mask, kv_compaction, recompact, threshold_compaction
from kvzap_export.ops.formats import UniformSelection, memory_report, trtllm_sparse_layout, uniform_selection

__all__ = [
    "Compaction", "UniformSelection", "keep_mask", "kv_compaction", "memory_report", "recompact", "threshold_compaction",
    "trtllm_sparse_layout", "uniform_selection",
]
