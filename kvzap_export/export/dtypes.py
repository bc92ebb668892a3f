"""The activation dtypes the exporters support, by the names users type."""

from __future__ import annotations

import torch
from onnx import TensorProto

from kvzap_export.errors import ConfigError

TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ONNX_DTYPES: dict[str, int] = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16", "float": "float32"}
OPSETS = (18, 19, 20)


def canonical_dtype(name: str) -> str:
    """'bf16' -> 'bfloat16'; raises ConfigError listing the supported names otherwise."""
    key = ALIASES.get(str(name).lower(), str(name).lower())
    if key not in TORCH_DTYPES:
        raise ConfigError(f"--dtype {name!r} is not supported; use one of {sorted(TORCH_DTYPES)} (or fp32/fp16/bf16)")
    return key


def check_opset(opset: int) -> int:
    if opset not in OPSETS:
        raise ConfigError(f"--opset {opset} is not supported; use one of {list(OPSETS)} (TensorRT 10 parses <= 20)")
    return opset
