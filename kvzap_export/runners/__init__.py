"""Backends that run an artifact: the PyTorch reference, ONNX Runtime (CPU) and TensorRT, one contract."""
