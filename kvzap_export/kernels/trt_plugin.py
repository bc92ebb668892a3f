"""The compaction plugin as a TensorRT "quickly deployable plugin" (``tensorrt.plugin``, TRT 10.x / 11.x).

``register_plugin()`` registers ``kvzap::KVzapThresholdCompaction`` version "1" — the op type, namespace and
version of the bundle's ``threshold_compaction_plugin.onnx`` node, so TensorRT's ONNX parser maps the node to
it. Three parts:

- ``register``: output descriptors from the input descriptors (keep bool and indices int32 shaped like
  ``scores``; counts int32 ``[batch, kv_heads]``); attribute ``sink`` (int).
- ``impl`` (JIT, needs Python at run time): launches the Triton kernel on TensorRT's stream through torch.
- ``aot_impl``: compiles the same Triton kernel to PTX (``compile_compaction_kernel``) with launch
  parameters and the scalar extras (``seq``, ``heads``) as shape expressions, so the engine carries the
  kernel and runs from C++ / trtexec without Python. Kernel argument order = QDP AOT order: input tensors
  (scores, lengths, threshold, window), scalars, output tensors (keep, counts, indices).

Status: the AOT compilation (Triton → PTX/cubin for sm_80/sm_90) runs in CI without a GPU; the
TensorRT-facing parts have never run (TensorRT cannot be installed here). Every ``trt.`` / ``trtp.`` name
used below is checked against the real TensorRT 11.4 bindings (tests/trt/test_trt_api_names.py).

Deliberately no ``from __future__ import annotations``: ``tensorrt.plugin`` reads the real annotations.
"""

from typing import Tuple, Union

from kvzap_export.errors import MissingDependencyError
from kvzap_export.export.compaction_onnx import PLUGIN_NAMESPACE, PLUGIN_OP

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_OP}"
BLOCK = 1024
TRITON_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
_registered = False


def compile_compaction_kernel(dtype: str, sink: int, arch: int | None = None):
    """Triton → PTX (and cubin) of the fused compaction kernel for one scores dtype and ``sink``.

    ``arch`` (e.g. 90) compiles for that GPU without needing one; ``None`` targets the current GPU.
    """
    from kvzap_export.kernels.triton_compaction import compaction_kernel, require_triton

    triton = require_triton()
    if dtype not in TRITON_DTYPES:
        raise ValueError(f"scores dtype {dtype!r} has no kernel; use one of {sorted(TRITON_DTYPES)}")
    signature = {"scores_ptr": f"*{TRITON_DTYPES[dtype]}", "lengths_ptr": "*i32", "threshold_ptr": "*fp32",
                 "window_ptr": "*i32", "seq": "i32", "heads": "i32",
                 "keep_ptr": "*i8", "counts_ptr": "*i32", "indices_ptr": "*i32"}
    source = triton.compiler.ASTSource(fn=compaction_kernel, signature=signature, constexprs={"SINK": sink, "BLOCK": BLOCK})
    if arch is None:
        return triton.compile(source)
    from triton.backends.compiler import GPUTarget

    return triton.compile(source, target=GPUTarget("cuda", arch, 32))


def register_plugin() -> str:
    """Registers the plugin with TensorRT's plugin registry (once); returns its id."""
    global _registered
    if _registered:
        return PLUGIN_ID
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ModuleNotFoundError:
        raise MissingDependencyError(
            "the TensorRT plugin needs TensorRT >= 10.7 with tensorrt.plugin: `pip install tensorrt` on a machine with a GPU"
        ) from None
    import torch

    from kvzap_export.kernels.triton_compaction import compaction_kernel, require_triton

    triton = require_triton()
    dtype_names = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16"}

    @trtp.register(PLUGIN_ID)
    def describe(scores: trtp.TensorDesc, lengths: trtp.TensorDesc, threshold: trtp.TensorDesc,
                 window: trtp.TensorDesc, sink: int) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        shape = scores.shape_expr
        keep = trtp.from_shape_expr(shape, dtype=trt.bool)
        counts = trtp.from_shape_expr((shape[0], shape[1]), dtype=trt.int32)
        indices = trtp.from_shape_expr(shape, dtype=trt.int32)
        return keep, counts, indices

    @trtp.impl(PLUGIN_ID)
    def run(scores: trtp.Tensor, lengths: trtp.Tensor, threshold: trtp.Tensor, window: trtp.Tensor, sink: int,
            outputs: Tuple[trtp.Tensor], stream: int) -> None:
        s = torch.as_tensor(scores, device="cuda")
        keep, counts, indices = (torch.as_tensor(o, device="cuda") for o in outputs)
        batch, heads, seq = s.shape
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            compaction_kernel[(batch * heads,)](
                s, torch.as_tensor(lengths, device="cuda"), torch.as_tensor(threshold, device="cuda"),
                torch.as_tensor(window, device="cuda"), seq, heads, keep.view(torch.int8), counts, indices,
                SINK=sink, BLOCK=min(BLOCK, triton.next_power_of_2(max(seq, 1))))

    @trtp.aot_impl(PLUGIN_ID)
    def compile_ahead(scores: trtp.TensorDesc, lengths: trtp.TensorDesc, threshold: trtp.TensorDesc,
                      window: trtp.TensorDesc, sink: int, outputs: Tuple[trtp.TensorDesc], tactic: int
                      ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        compiled = compile_compaction_kernel(dtype_names[scores.dtype], sink)
        shape = scores.shape_expr
        launch = trtp.KernelLaunchParams()
        launch.grid_x = shape[0] * shape[1]  # one program per (sequence, KV head)
        launch.block_x = compiled.metadata.num_warps * 32
        launch.shared_mem = compiled.metadata.shared
        extra = trtp.SymIntExprs(2)
        extra[0] = trtp.SymInt32(shape[2])  # seq
        extra[1] = trtp.SymInt32(shape[1])  # heads
        return compiled.metadata.name, compiled.asm["ptx"], launch, extra

    _registered = True
    return PLUGIN_ID
