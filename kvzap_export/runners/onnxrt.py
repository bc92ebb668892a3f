"""ONNX Runtime on the CPU: a session helper and the custom-op kernel of the compaction plugin node.

The plugin node's kernel (via onnxruntime-extensions) is ``compaction_spec.threshold_compaction_by_spec``: the
rule written from its specification in NumPy, sharing no code with the PyTorch reference, so the plugin node's
operator check compares two independent computations (and the node's names, attributes and I/O, which TensorRT's
plugin also serves). onnxruntime-extensions' Python ops take one signature per op type and no float16/bfloat16
tensors: the ORT kernel takes float32 scores only.
"""

from __future__ import annotations

import functools
from pathlib import Path

from kvzap_export.errors import MissingDependencyError


@functools.lru_cache(maxsize=1)
def _define_ops() -> str:
    try:
        from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op
    except ModuleNotFoundError:
        raise MissingDependencyError(
            "running the plugin node in ONNX Runtime needs onnxruntime-extensions: pip install 'kvzap-export[ortx]'"
        ) from None
    import numpy as np

    from kvzap_export.export.compaction_onnx import PLUGIN_OP
    from kvzap_export.runners.compaction_spec import threshold_compaction_by_spec

    @onnx_op(op_type=PLUGIN_OP,
             inputs=[PyCustomOpDef.dt_float, PyCustomOpDef.dt_int32, PyCustomOpDef.dt_float, PyCustomOpDef.dt_int32],
             outputs=[PyCustomOpDef.dt_bool, PyCustomOpDef.dt_int32, PyCustomOpDef.dt_int32],
             attrs={"sink": PyCustomOpDef.dt_int64, "plugin_version": PyCustomOpDef.dt_string,
                    "plugin_namespace": PyCustomOpDef.dt_string})
    def kvzap_threshold_compaction(scores, lengths, threshold, window, **attrs):
        return threshold_compaction_by_spec(np.array(scores), np.array(lengths), np.asarray(threshold).item(),
                                            int(np.asarray(window)), int(attrs.get("sink", 0)))

    return get_library_path()


def register_custom_ops(options) -> None:
    """Makes ``options`` (an ``onnxruntime.SessionOptions``) able to run the plugin node."""
    options.register_custom_ops_library(_define_ops())


def ort_session(source: str | Path | bytes, custom_ops: bool = False, threads: int | None = None,
                providers: tuple[str, ...] = ("CPUExecutionProvider",)):
    """An ``onnxruntime.InferenceSession`` for an ONNX file (or serialized model bytes), on ``providers``
    (default: the CPU provider; ``validate --device cuda`` passes the CUDA provider first when ORT has it). A
    requested provider the session does not use (ONNX Runtime's silent fallback) is a MissingDependencyError.

    ``custom_ops`` registers the plugin-node kernel (needed for ``threshold_compaction_plugin``);
    ``threads`` caps intra-op threads (``None``: ONNX Runtime's default, one per core). Idle worker threads
    do not spin between runs: spinning starves the torch work that runs between calls (model-level checks,
    the e2e benchmark, interleaved timings) on small machines.
    """
    try:
        import onnxruntime as ort
    except ModuleNotFoundError:
        raise MissingDependencyError("running ONNX graphs needs onnxruntime: pip install onnxruntime") from None
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads is not None:
        options.intra_op_num_threads = threads
    if custom_ops:
        register_custom_ops(options)
    session = ort.InferenceSession(source if isinstance(source, bytes) else str(source), options,
                                   providers=list(providers))
    # ONNX Runtime drops a requested provider it cannot start (not built in, a CUDA library missing) with a
    # warning only, and runs on the rest: a --device cuda check would then run on the CPU under a CUDA label.
    used = session.get_providers()
    dropped = [p for p in providers if p not in used]
    if dropped:
        raise MissingDependencyError(f"ONNX Runtime fell back to {', '.join(used)}: {', '.join(dropped)} was asked for "
                                     "but did not start (install onnxruntime-gpu matching this CUDA, or use --device cpu)")
    return session
