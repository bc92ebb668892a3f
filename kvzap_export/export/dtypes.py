"""Dtypes by the names users type and the manifest records: the project's one table of them.

``TORCH_DTYPES`` maps every dtype name the bundle's tensors use to its torch dtype, ``ONNX_DTYPES`` to its ONNX
element type; ``ACTIVATION_DTYPES`` are those a model (``--dtype``) can run in. Anything else that needs a
dtype by name (the TensorRT runner, scripts) looks it up here.
"""

from __future__ import annotations

import torch
from onnx import TensorProto

from kvzap_export.errors import ConfigError

TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                                        "int32": torch.int32, "int64": torch.int64, "bool": torch.bool}
ONNX_DTYPES: dict[str, int] = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16,
                               "int32": TensorProto.INT32, "int64": TensorProto.INT64, "bool": TensorProto.BOOL}
ACTIVATION_DTYPES = ("float32", "float16", "bfloat16")
ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16", "float": "float32"}
OPSETS = (18, 19, 20)
_NAME_OF_ONNX = {value: name for name, value in ONNX_DTYPES.items()}


def canonical_dtype(name: str) -> str:
    """'bf16' -> 'bfloat16'; raises ConfigError listing the supported activation dtypes otherwise."""
    key = ALIASES.get(str(name).lower(), str(name).lower())
    if key not in ACTIVATION_DTYPES:
        raise ConfigError(f"--dtype {name!r} is not supported; use one of {sorted(ACTIVATION_DTYPES)} (or fp32/fp16/bf16)")
    return key


def check_opset(opset: int) -> int:
    if opset not in OPSETS:
        raise ConfigError(f"--opset {opset} is not supported; use one of {list(OPSETS)} (TensorRT 10 parses <= 20)")
    return opset


def graph_io(model) -> tuple[dict, dict]:
    """An ONNX model's inputs and outputs as the manifest records them: ``{name: [dtype name, shape]}``.

    Symbolic dimensions are their names, fixed ones their sizes; an element type outside the table is its
    ONNX number as a string (so ``verify`` reports it rather than failing).
    """
    def spec(values):
        out = {}
        for value in values:
            tensor = value.type.tensor_type
            out[value.name] = [_NAME_OF_ONNX.get(tensor.elem_type, str(tensor.elem_type)),
                               [d.dim_param or d.dim_value for d in tensor.shape.dim]]
        return out

    return spec(model.graph.input), spec(model.graph.output)
