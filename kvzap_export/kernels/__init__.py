"""GPU kernels of threshold compaction (Triton; CUDA C in plugins/) and their torch / TensorRT bindings.

- ``triton_compaction``: the fused decision kernel and the K/V move, with launchers;
- ``torch_ops``: the ``kvzap::threshold_compaction`` / ``kvzap::kv_compaction`` torch custom ops;
- ``trt_plugin``: the TensorRT ``tensorrt.plugin`` registration (AOT: the kernel's PTX carried by the engine).

Importing ``kvzap_export.kernels`` needs neither triton nor tensorrt. The launchers are also reachable here
(``kvzap_export.kernels.triton_threshold_compaction``); they import the Triton module on first access.
"""

_LAUNCHERS = {"triton_threshold_compaction", "triton_kv_compaction"}


def __getattr__(name: str):
    if name in _LAUNCHERS:
        from kvzap_export.kernels import triton_compaction

        return getattr(triton_compaction, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
