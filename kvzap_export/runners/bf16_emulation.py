"""Run a bfloat16 ONNX graph on ONNX Runtime CPU, which has no bfloat16 kernels for Gemm/Gelu/Less.

The rewrite keeps the graph's structure and weights and reproduces bfloat16 arithmetic node by node:
bfloat16 initializers and constants become float32 (exact widening), and every tensor the original
graph types as bfloat16 — graph inputs and node outputs alike — is rounded to bfloat16 and widened
back (``Cast(to=BFLOAT16)`` → ``Cast(to=FLOAT)``). Each node therefore computes in float32 on
bfloat16-exact operands and rounds its result once, which is what PyTorch's CPU bfloat16 kernels
do (float32 accumulation, one rounding per op). On the SmolLM2 surrogates the emulated graph equals
``Surrogate.score`` in bfloat16 bit for bit on all but a few elements in 10^4, which differ by a few
bfloat16 ulps because the two float32 accumulations sum in different orders
(tests/runners/test_bf16_emulation.py).

It is an emulation: a TensorRT bfloat16 engine may fuse nodes and round less often. Reports name
the backend ``onnxrt-bf16emu`` so nobody mistakes it for a native bfloat16 run.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

BF16, FLOAT = TensorProto.BFLOAT16, TensorProto.FLOAT


def _widen(tensor: TensorProto) -> TensorProto:
    return numpy_helper.from_array(np.asarray(numpy_helper.to_array(tensor), dtype=np.float32), tensor.name)


def _round_trip(src: str, dst: str) -> list[onnx.NodeProto]:
    rounded = f"{dst}__bf16emu_rounded"
    return [helper.make_node("Cast", [src], [rounded], to=BF16, name=f"{rounded}_cast"),
            helper.make_node("Cast", [rounded], [dst], to=FLOAT, name=f"{dst}__bf16emu_widen")]


def _bf16_value_names(model: onnx.ModelProto) -> set[str]:
    inferred = onnx.shape_inference.infer_shapes(model)
    infos = list(inferred.graph.value_info) + list(inferred.graph.output)
    return {vi.name for vi in infos if vi.type.tensor_type.elem_type == BF16}


def emulate_bf16(model: onnx.ModelProto) -> onnx.ModelProto:
    """A float32 copy of ``model`` that rounds every bfloat16 tensor of the original to bfloat16."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    if graph.node and any(n.op_type in ("If", "Loop", "Scan") for n in graph.node):
        raise ValueError("bf16 emulation does not rewrite graphs with subgraphs (If/Loop/Scan)")
    bf16_values = _bf16_value_names(model)
    for init in graph.initializer:
        if init.data_type == BF16:
            init.CopyFrom(_widen(init))
    nodes: list[onnx.NodeProto] = []
    renamed: dict[str, str] = {}
    for vi in graph.input:
        if vi.type.tensor_type.elem_type == BF16:
            vi.type.tensor_type.elem_type = FLOAT
            # A bfloat16 engine receives bfloat16: round whatever float32 the caller feeds.
            renamed[vi.name] = f"{vi.name}__bf16emu_in"
            nodes += _round_trip(vi.name, renamed[vi.name])
    for vi in graph.output:
        if vi.type.tensor_type.elem_type == BF16:
            vi.type.tensor_type.elem_type = FLOAT
    for node in graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = renamed.get(name, name)
        if node.op_type == "Cast":
            for attr in node.attribute:
                if attr.name == "to" and attr.i == BF16:
                    attr.i = FLOAT
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == BF16:
                attr.t.CopyFrom(_widen(attr.t))
        wrapped = []
        for i, name in enumerate(node.output):
            if name in bf16_values:
                node.output[i] = f"{name}__bf16emu_raw"
                wrapped.append(name)
        nodes.append(node)
        for name in wrapped:
            nodes += _round_trip(f"{name}__bf16emu_raw", name)
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.value_info[:]
    onnx.checker.check_model(model)
    return model
