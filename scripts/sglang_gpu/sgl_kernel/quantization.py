"""``sgl_kernel.quantization`` of kvzap-export's CUDA stand-in (see the package docstring). SGLang 0.5.23 imports these
GGUF ops when ``srt/layers/quantization/gguf.py`` loads on CUDA (line 49); only GGUF-quantized models call them,
which the stand-in does not cover: each raises ``NotImplementedError`` naming itself."""

from __future__ import annotations

from sgl_kernel import NotProvided, _not_provided

_IMPORTED_NOT_PROVIDED = ("ggml_dequantize", "ggml_moe_a8", "ggml_mul_mat_a8", "ggml_mul_mat_vec_a8")
globals().update({name: _not_provided(f"quantization.{name}") for name in _IMPORTED_NOT_PROVIDED})


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise NotProvided(f"sgl_kernel.quantization.{name} is not provided by kvzap-export's CUDA stand-in for sgl-kernel")
