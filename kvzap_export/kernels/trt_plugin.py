"""The compaction plugin as a TensorRT "quickly deployable plugin" (``tensorrt.plugin``, TRT 10.x / 11.x).

``register_plugin()`` registers ``kvzap::KVzapThresholdCompaction`` version "1" — the op type, namespace and
version of the bundle's ``threshold_compaction_plugin.onnx`` node, so TensorRT's ONNX parser maps the node to
it. Three parts:

- ``register``: output descriptors from the input descriptors (keep int32 0/1 and indices int32 shaped like
  ``scores``; counts int32 ``[batch, kv_heads]``); attribute ``sink`` (int).
- ``impl`` (JIT, needs Python and torch at run time): launches the Triton kernel on TensorRT's stream.
- ``aot_impl``: compiles the same Triton kernel to PTX (``compile_compaction_kernel``) and returns its name,
  the PTX, launch parameters (grid = batch × kv_heads × max(cdiv(seq, CHUNK_T), 1) programs, block =
  num_warps × 32 threads, Triton's shared memory) and the scalar extras ``seq``, ``heads`` as shape expressions. The engine then carries the
  kernel and runs from C++ / trtexec without Python. Kernel argument order = QDP AOT order: input tensors
  (scores, lengths, threshold, window), extras (seq, heads), output tensors (keep, counts, indices).

With both implementations registered, TensorRT needs a preference when the network is created:
``trt.NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS`` (or ``..._JIT_...``); ``register_plugin(jit=False)``
registers the AOT implementation alone.

Triton (≥ 3.3) appends hidden scratch-buffer parameters to every kernel; TensorRT passes only the
parameters above, so ``ptx_for_tensorrt`` removes the trailing ones after checking that the kernel never
reads them (no scratch memory is used by this kernel).

Status: the AOT compilation (Triton → PTX for sm_80/sm_90) runs in the tests without a GPU; the
TensorRT-facing parts have never run (TensorRT cannot be installed here). Every ``trt.`` / ``trtp.`` name
used below exists in the real TensorRT 11.4 bindings (tests/trt/test_trt_api_names.py).

Deliberately no ``from __future__ import annotations``: ``tensorrt.plugin`` reads the real annotations.
"""

import re
from typing import Tuple, Union

from kvzap_export.errors import MissingDependencyError
from kvzap_export.export.compaction_onnx import PLUGIN_NAMESPACE, PLUGIN_OP

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_OP}"
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


def register_plugin(aot: bool = True, jit: bool = True) -> str:
    """Registers the plugin with TensorRT's plugin registry (once per process); returns its id.

    ``aot`` registers the ahead-of-time implementation (PTX in the engine), ``jit`` the Python one.
    """
    global _registered
    if _registered:
        return PLUGIN_ID
    if not (aot or jit):
        raise ValueError("register_plugin needs at least one implementation: aot=True or jit=True")
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ModuleNotFoundError:
        raise MissingDependencyError(
            "the TensorRT plugin needs TensorRT >= 10.8 with tensorrt.plugin: install TensorRT from NVIDIA's index on a GPU machine"
        ) from None
    import torch

    from kvzap_export.kernels import triton_compaction

    triton_compaction.require_triton()
    dtype_names = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16",
                   trt.int32: "int32", trt.int64: "int64"}
    # __cuda_array_interface__ typestr and the torch dtype to view the buffer as (no bfloat16 in that protocol).
    torch_views = {trt.float32: ("<f4", torch.float32), trt.float16: ("<f2", torch.float16),
                   trt.bfloat16: ("<i2", torch.bfloat16), trt.int32: ("<i4", torch.int32),
                   trt.int64: ("<i8", torch.int64), trt.bool: ("|i1", torch.int8)}

    def as_torch(tensor) -> torch.Tensor:
        typestr, view = torch_views[tensor.dtype]
        buffer = _CudaBuffer(tuple(tensor.shape), typestr, tensor.data_ptr)
        return torch.as_tensor(buffer, device="cuda").view(view)

    @trtp.register(PLUGIN_ID)
    def describe(scores: trtp.TensorDesc, lengths: trtp.TensorDesc, threshold: trtp.TensorDesc,
                 window: trtp.TensorDesc, sink: int) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        shape = scores.shape_expr
        # TensorRT plugins cannot output bool: keep is int32 0/1; the bundle's graph casts it to bool after the node.
        keep = trtp.from_shape_expr(shape, dtype=trt.int32)
        counts = trtp.from_shape_expr((shape[0], shape[1]), dtype=trt.int32)
        indices = trtp.from_shape_expr(shape, dtype=trt.int32)
        return keep, counts, indices

    if jit:
        @trtp.impl(PLUGIN_ID)
        def run(scores: trtp.Tensor, lengths: trtp.Tensor, threshold: trtp.Tensor, window: trtp.Tensor, sink: int,
                outputs: Tuple[trtp.Tensor], stream: int) -> None:
            s = as_torch(scores)
            keep, counts, indices = (as_torch(o) for o in outputs)
            batch, heads, seq = s.shape
            if batch * heads == 0:
                return
            config = triton_compaction.compaction_config(seq, triton_compaction.BLOCK_T, triton_compaction.CHUNK_T)
            with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
                triton_compaction.compaction_kernel[(config.programs(batch, heads, seq),)](
                    s, as_torch(lengths), as_torch(threshold), as_torch(window), seq, heads, keep, counts, indices,
                    SINK=sink, BLOCK=config.block, CHUNK=config.chunk, num_warps=config.num_warps)

    if aot:
        @trtp.aot_impl(PLUGIN_ID)
        def compile_ahead(scores: trtp.TensorDesc, lengths: trtp.TensorDesc, threshold: trtp.TensorDesc,
                          window: trtp.TensorDesc, sink: int, outputs: Tuple[trtp.TensorDesc], tactic: int
                          ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
            names = {}
            for name, desc in (("scores", scores), ("lengths", lengths), ("threshold", threshold), ("window", window)):
                if desc.dtype not in dtype_names:
                    raise ValueError(f"{PLUGIN_ID}: input {name} has dtype {desc.dtype}, which has no kernel")
                names[name] = dtype_names[desc.dtype]
            compiled = compile_compaction_kernel(names["scores"], sink, lengths_dtype=names["lengths"],
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


class _CudaBuffer:
    """A contiguous device buffer described by ``__cuda_array_interface__`` (v3), for ``torch.as_tensor``."""

    def __init__(self, shape: tuple, typestr: str, pointer: int):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (int(pointer), False),
                                         "strides": None, "version": 3}

