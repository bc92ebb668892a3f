"""GPU kernels of threshold compaction (Triton; CUDA C in plugins/) and their torch / TensorRT bindings.

Import the submodules directly; each imports triton / tensorrt lazily or guarded so that importing
``kvzap_export.kernels`` never needs them.
"""
