"""The compaction plugin as a TensorRT "quickly deployable plugin" (``tensorrt.plugin``, AOT implementation).

``kvzap-export build --python-plugin`` builds the bundle's plugin-node engine with it instead of the C++ library
(``plugins/``, ``--plugin-lib``): nothing to compile with CMake against TensorRT's headers, and the engine carries
the kernel's code, so trtexec or a C++ runtime runs it without Python and without a plugin library.

``register_plugin()`` registers ``kvzap_aot::KVzapThresholdCompaction`` version "1": the bundle's op type under a
namespace of its own, so it never collides with the C++ plugin (``kvzap::KVzapThresholdCompaction``) when both are
loaded in one process; the builder points its copy of the plugin node at it (``python_plugin_graph``). Two parts:

- ``register``: output descriptors from the input descriptors (keep int32 0/1 and indices int32 shaped like
  ``scores``; counts int32 ``[batch, kv_heads]``); attribute ``sink`` (int).
- ``aot_impl``: compiles the Triton kernel to PTX (``compile_compaction_kernel``) and returns its name, the PTX,
  launch parameters (grid = batch × kv_heads × max(cdiv(seq, CHUNK_T), 1) programs, block = num_warps × 32
  threads, Triton's shared memory) and the scalar extras ``seq``, ``heads`` as shape expressions. Kernel argument
  order = QDP AOT order: input tensors (scores, lengths, threshold, window), extras (seq, heads), output tensors
  (keep, counts, indices). The PTX targets sm_80 (``PTX_ARCH``) whatever GPU builds the engine: PTX is compiled
  forward to any later GPU, so the plugin suits ``--hardware-compat ampere+`` engines and every GPU TensorRT 10/11
  runs on from Ampere on; the kernel (no tensor cores, no Hopper-only instructions) loses nothing by it.

No JIT implementation (``@trtp.impl``) is registered: it would call back into Python and torch inside every process
that runs the engine, and with both registered TensorRT needs a preference flag at network creation. The builder
still sets ``NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS`` so the choice is explicit.

Triton (≥ 3.3) appends hidden scratch-buffer parameters to every kernel; TensorRT passes only the parameters above,
so ``ptx_for_tensorrt`` removes the trailing ones after checking that the kernel never reads them.

Status: the AOT compilation (Triton → PTX) runs in the tests without a GPU, and the registration and the builder's
use of it run against a stand-in of ``tensorrt.plugin`` (tests/kernels/test_trt_plugin.py); nothing here has run
inside TensorRT (it cannot be installed here). Every ``trt.`` / ``trtp.`` name used below exists in the real
TensorRT 11.4 bindings (tests/trt/test_trt_api_names.py).

Deliberately no ``from __future__ import annotations``: ``tensorrt.plugin`` reads the real annotations.
"""

import importlib.util
import re
from typing import Tuple, Union

from kvzap_export.errors import BundleError, MissingDependencyError
from kvzap_export.export.compaction_onnx import PLUGIN_NAMESPACE, PLUGIN_OP

QDP_NAMESPACE = f"{PLUGIN_NAMESPACE}_aot"  # not the C++ plugin's namespace: both can be registered in one process
PLUGIN_ID = f"{QDP_NAMESPACE}::{PLUGIN_OP}"
PTX_ARCH = 80  # the oldest GPU TensorRT 10/11 engines (and ampere+ compatibility) cover; later GPUs compile it forward
INSTALL = ("install a TensorRT whose tensorrt.plugin has AOT implementations (aot_impl; the 11.x line has them) from "
           "NVIDIA's index on a GPU machine")
KERNEL_PARAMS = ("scores_ptr", "lengths_ptr", "threshold_ptr", "window_ptr", "seq", "heads",
                 "keep_ptr", "counts_ptr", "indices_ptr")
TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int32": "i32", "int64": "i64"}
# Lowest PTX ISA per GPU architecture that our kernel needs. Triton otherwise writes the newest ISA its own
# ptxas knows (9.4 with Triton 3.9), which an older driver or TensorRT's PTX compiler may reject.
MIN_PTX_VERSION = {80: 80, 86: 80, 87: 80, 89: 80, 90: 80, 100: 86, 101: 86, 103: 88, 120: 87, 121: 88}
_registered = False


def compile_compaction_kernel(scores_dtype: str, sink: int, arch: Union[int, None] = None, *,
                              lengths_dtype: str = "int32", threshold_dtype: str = "float32",
                              window_dtype: str = "int32"):
    """Triton → PTX of the fused compaction kernel (``compaction_kernel``) for these input dtypes and ``sink``.

    dtypes are torch-style names ("bfloat16", "int32"...). ``arch`` (e.g. 90) compiles for that GPU without
    needing one; ``None`` targets the current GPU. The PTX uses the lowest ISA the architecture allows
    (``MIN_PTX_VERSION``: 8.0 up to Hopper, so any CUDA 12+ driver accepts it). Returns Triton's compiled kernel (``.asm["ptx"]``,
    ``.metadata.name / num_warps / shared``).
    """
    from kvzap_export.kernels.triton_compaction import BLOCK_T, CHUNK_T, COMPACTION_WARPS, compaction_kernel, require_triton

    triton = require_triton()
    wanted = {"scores": (scores_dtype, ("float32", "float16", "bfloat16")), "lengths": (lengths_dtype, ("int32", "int64")),
              "threshold": (threshold_dtype, ("float32", "float16", "bfloat16")), "window": (window_dtype, ("int32", "int64"))}
    for name, (dtype, allowed) in wanted.items():
        if dtype not in allowed:
            raise ValueError(f"{name} dtype {dtype!r} has no compaction kernel; use one of {list(allowed)}")
    signature = {"scores_ptr": f"*{TRITON_TYPES[scores_dtype]}", "lengths_ptr": f"*{TRITON_TYPES[lengths_dtype]}",
                 "threshold_ptr": f"*{TRITON_TYPES[threshold_dtype]}", "window_ptr": f"*{TRITON_TYPES[window_dtype]}",
                 "seq": "i32", "heads": "i32", "keep_ptr": "*i32", "counts_ptr": "*i32", "indices_ptr": "*i32"}
    source = triton.compiler.ASTSource(fn=compaction_kernel, signature=signature,
                                       constexprs={"SINK": int(sink), "BLOCK": BLOCK_T, "CHUNK": CHUNK_T})
    if arch is None:
        target = triton.runtime.driver.active.get_current_target()
    else:
        from triton.backends.compiler import GPUTarget

        target = GPUTarget("cuda", arch, 32)
    options = {"num_warps": COMPACTION_WARPS}
    if target.arch in MIN_PTX_VERSION:
        options["ptx_version"] = MIN_PTX_VERSION[target.arch]
    return triton.compile(source, target=target, options=options)


def ptx_for_tensorrt(compiled) -> str:
    """The kernel's PTX with exactly the ``KERNEL_PARAMS`` TensorRT passes (Triton's trailing scratch params removed).

    Raises RuntimeError if the kernel needs scratch memory or reads a parameter that would be removed.
    """
    meta = compiled.metadata
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        raise RuntimeError(f"kernel {meta.name} needs Triton scratch memory, which TensorRT's AOT launch does not provide")
    ptx = compiled.asm["ptx"]
    header = re.search(rf"\.entry\s+{re.escape(meta.name)}\s*\((.*?)\)", ptx, flags=re.S)
    if header is None:
        raise RuntimeError(f"no .entry {meta.name} in the PTX Triton produced")
    params = [p.strip() for p in header.group(1).split(",")]
    if len(params) < len(KERNEL_PARAMS):
        raise RuntimeError(f"kernel {meta.name} has {len(params)} parameters, expected at least {len(KERNEL_PARAMS)}")
    dropped = params[len(KERNEL_PARAMS):]
    for param in dropped:
        param_name = param.split()[-1]
        if re.search(rf"\[{re.escape(param_name)}\b", ptx):
            raise RuntimeError(f"kernel {meta.name} reads its hidden parameter {param_name}; it cannot run under TensorRT")
    kept = ",\n\t".join(params[: len(KERNEL_PARAMS)])
    return ptx[: header.start(1)] + "\n\t" + kept + "\n" + ptx[header.end(1):]


def python_plugin_graph(model):
    """A copy of the bundle's plugin graph whose ``KVzapThresholdCompaction`` node names this plugin's namespace.

    TensorRT's ONNX parser finds a plugin by the node's op type, ``plugin_version`` and ``plugin_namespace``
    attributes; the bundle's graph names the C++ plugin's namespace (``kvzap``). model: onnx.ModelProto.
    """
    import onnx
    from onnx import helper

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    nodes = [node for node in copy.graph.node if node.op_type == PLUGIN_OP]
    if len(nodes) != 1:
        raise BundleError(f"the plugin graph has {len(nodes)} {PLUGIN_OP} node(s), expected one; re-export the bundle")
    kept = [a for a in nodes[0].attribute if a.name != "plugin_namespace"]
    del nodes[0].attribute[:]
    nodes[0].attribute.extend([*kept, helper.make_attribute("plugin_namespace", QDP_NAMESPACE)])
    return copy


def python_plugin_status() -> str | None:
    """None when the AOT plugin can be built here (a TensorRT whose ``tensorrt.plugin`` has AOT implementations, and
    Triton to compile the kernel), else why not, in one line."""
    try:
        import tensorrt as trt
        import tensorrt.plugin  # noqa: F401
    except ModuleNotFoundError:
        return f"the Python TensorRT plugin needs tensorrt.plugin: {INSTALL}"
    if getattr(trt, "QuickPluginCreationRequest", None) is None:  # what tensorrt.plugin itself tests for AOT support
        return f"TensorRT {trt.__version__} has no AOT Python plugins: {INSTALL}"
    if importlib.util.find_spec("triton") is None:
        return "the Python TensorRT plugin compiles its kernel with Triton: pip install 'kvzap-export[gpu]'"
    return None


def register_plugin() -> str:
    """Registers the AOT plugin with TensorRT's plugin registry (once per process); returns its id.

    Raises MissingDependencyError without TensorRT's ``tensorrt.plugin`` AOT support or without Triton.
    """
    global _registered
    if _registered:
        return PLUGIN_ID
    why_not = python_plugin_status()
    if why_not is not None:
        raise MissingDependencyError(why_not)
    import tensorrt as trt
    import tensorrt.plugin as trtp

    from kvzap_export.kernels import triton_compaction

    triton_compaction.require_triton()
    dtype_names = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16",
                   trt.int32: "int32", trt.int64: "int64"}

    @trtp.register(PLUGIN_ID)
    def describe(scores: trtp.TensorDesc, lengths: trtp.TensorDesc, threshold: trtp.TensorDesc,
                 window: trtp.TensorDesc, sink: int) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        shape = scores.shape_expr
        # TensorRT plugins cannot output bool: keep is int32 0/1; the bundle's graph casts it to bool after the node.
        keep = trtp.from_shape_expr(shape, dtype=trt.int32)
        counts = trtp.from_shape_expr((shape[0], shape[1]), dtype=trt.int32)
        indices = trtp.from_shape_expr(shape, dtype=trt.int32)
        return keep, counts, indices

    @trtp.aot_impl(PLUGIN_ID)
    def compile_ahead(scores: trtp.TensorDesc, lengths: trtp.TensorDesc, threshold: trtp.TensorDesc,
                      window: trtp.TensorDesc, sink: int, outputs: Tuple[trtp.TensorDesc], tactic: int
                      ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        names = {}
        for name, desc in (("scores", scores), ("lengths", lengths), ("threshold", threshold), ("window", window)):
            if desc.dtype not in dtype_names:
                raise ValueError(f"{PLUGIN_ID}: input {name} has dtype {desc.dtype}, which has no kernel")
            names[name] = dtype_names[desc.dtype]
        compiled = compile_compaction_kernel(names["scores"], sink, PTX_ARCH, lengths_dtype=names["lengths"],
                                             threshold_dtype=names["threshold"], window_dtype=names["window"])
        shape = scores.shape_expr
        launch = trtp.KernelLaunchParams()
        # One program per (sequence, KV head, chunk of CHUNK_T tokens), at least one per row.
        launch.grid_x = shape[0] * shape[1] * trtp.max(trtp.cdiv(shape[2], triton_compaction.CHUNK_T), 1)
        launch.block_x = compiled.metadata.num_warps * 32
        launch.shared_mem = compiled.metadata.shared
        extra = trtp.SymIntExprs(2)
        extra[0] = trtp.SymInt32(shape[2])  # seq
        extra[1] = trtp.SymInt32(shape[1])  # heads
        return compiled.metadata.name, ptx_for_tensorrt(compiled), launch, extra

    _registered = True
    return PLUGIN_ID
