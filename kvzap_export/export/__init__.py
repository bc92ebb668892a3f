"""ONNX exporters: per-layer surrogates and the threshold-compaction op."""
