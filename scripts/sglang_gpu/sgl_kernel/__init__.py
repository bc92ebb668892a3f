"""kvzap-export's CUDA stand-in for sgl-kernel: plain-torch versions of the sgl-kernel ops that SGLang 0.5.23 calls on
a CUDA machine for dense Llama and Qwen3 with ``--attention-backend triton --sampling-backend pytorch``. A stand-in,
not sgl-kernel: it exists because the GPU machines this project borrows have no network and sgl-kernel's wheels are
CUDA binaries built against another torch. ``scripts/sglang_gpu/build_engine.py`` packs it (with a
``sglang_kernel-*.dist-info`` that says so) into the bundle for those machines; it is not part of ``kvzap_export``.

Which sgl-kernel names SGLang 0.5.23 touches on that path, and where (paths under ``sglang/``):

Called, implemented here (torch; same results as SGLang's own ``forward_native`` up to float rounding):
- ``rmsnorm``, ``fused_add_rmsnorm``: ``RMSNorm.forward_cuda`` (``srt/layers/layernorm.py:628, 631``), every
  decoder layer; also Qwen3's q/k norm when SGLang's JIT q/k-norm kernel cannot be built
  (``srt/models/utils.py:543-546`` falls back to ``RMSNorm``).
- ``silu_and_mul``: ``SiluAndMul.forward_cuda`` (``srt/layers/activation.py:149``, via line 95) sends to sgl-kernel the
  shapes whose width is not a multiple of 16 bytes' worth of elements; aligned shapes go to SGLang's JIT kernel.
- ``weak_ref_tensor``: the breakable CUDA graph that SGLang 0.5.23 captures for prefill by default on CUDA
  (``srt/model_executor/runner_backend_utils/weak_ref_tensor.py:8``, used by ``breakable_cuda_graph.py:176``).
  Here it returns an alias that holds a reference (``Tensor.detach``): same storage, same values; the memory it
  points at is not handed back to the graph pool while the alias lives (sgl-kernel's version holds none).
- ``utils.is_arch_support_pdl``: the Triton attention backend's PDL switch (``srt/layers/attention/triton_backend.py:71,
  340``): compute capability major >= 9, as sgl-kernel answers.

Imported when a module loads on CUDA, never called on that path: each raises ``NotImplementedError`` naming itself
if called (``_IMPORTED_NOT_PROVIDED`` below, and the submodules ``kvcacheio`` and ``quantization``).

Every other name raises ``NotProvided`` (an ``AttributeError``, so ``from sgl_kernel import x`` is an ``ImportError``
as with a build that lacks ``x``). Submodules that are not here (``allreduce``, ``scalar_type``, ``flash_attn``,
...) are absent, which SGLang handles where it imports them on this path: custom all-reduce is switched off
(``srt/distributed/device_communicators/custom_all_reduce_ops.py:20-26``, one GPU needs none) and the quantization
helpers use their own placeholder scalar types (``srt/layers/quantization/utils.py:26-39``). ``torch.ops.sgl_kernel``
stays empty. Rotary embedding, the KV-cache store, Qwen3's fused q/k norm and aligned SiLU-and-mul are not sgl-kernel
ops on CUDA in 0.5.23: SGLang builds them with its own JIT (``sglang.kernels``, tvm-ffi + nvcc), so they are not here.
"""

from __future__ import annotations

import torch

from sgl_kernel.utils import is_arch_support_pdl  # noqa: F401  (sgl-kernel exports it at the top level too)

__version__ = "0.4.9+kvzap.standin"

_WHY = "is not provided by kvzap-export's CUDA stand-in for sgl-kernel (scripts/sglang_gpu/sgl_kernel)"


def rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None,
            enable_pdl: bool | None = None) -> torch.Tensor:
    """``input / sqrt(mean(input**2, -1) + eps) * weight``, computed in float32 and returned in input's dtype.

    input: [tokens, hidden] (any leading shape); weight: [hidden]; out: like input, written if given.
    """
    del enable_pdl  # a launch option of the CUDA kernel
    result = _normalized(input.float(), weight, eps).to(input.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                      enable_pdl: bool | None = None) -> None:
    """In place: ``residual += input``, then ``input = rmsnorm(residual) * weight``.

    The sum is formed in float32; ``residual`` keeps it rounded to its dtype, the normalization reads the float32 sum.
    input, residual: [tokens, hidden]; weight: [hidden].
    """
    del enable_pdl
    total = input.float() + residual.float()
    residual.copy_(total)
    input.copy_(_normalized(total, weight, eps))


def _normalized(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: float32 [..., hidden] -> float32, normalized over the last axis and scaled by weight."""
    return x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps) * weight.float()


def silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` where input = [gate | up] on the last axis, computed in float32.

    input: [..., 2 * d]; out: [..., d] in input's dtype, written if given. Like sgl-kernel, refuses an input whose
    rows are not a multiple of 16 bytes (its vector loads need that).
    """
    if input.shape[-1] * input.element_size() % 16 != 0:
        raise ValueError(f"sgl_kernel.silu_and_mul (stand-in): rows of {input.shape[-1]} x {input.element_size()} bytes "
                         "are not a multiple of 16 bytes, which sgl-kernel's kernel requires")
    half = input.shape[-1] // 2
    if out is not None and (out.shape[:-1] != input.shape[:-1] or out.shape[-1] != half):
        raise ValueError(f"sgl_kernel.silu_and_mul (stand-in): out {tuple(out.shape)} does not fit input "
                         f"{tuple(input.shape)}")
    x = input.float()
    result = (torch.nn.functional.silu(x[..., :half]) * x[..., half:]).to(input.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over the same memory (same data pointer, shape, strides); unlike sgl-kernel's, it holds a reference."""
    return tensor.detach()


def _not_provided(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} {_WHY}: SGLang imports it on CUDA but calls it only on paths the "
                                  "stand-in does not cover")

    op.__name__ = op.__qualname__ = name
    return op


# Imported at module level by SGLang 0.5.23 on CUDA (so they must exist), never called on the path above.
_IMPORTED_NOT_PROVIDED = (
    "gemma_rmsnorm", "gemma_fused_add_rmsnorm",  # srt/layers/layernorm.py:102 (Gemma norms)
    "gelu_and_mul", "gelu_tanh_and_mul",  # srt/layers/activation.py:60-61 (GELU models)
    "top_k_renorm_prob", "top_p_renorm_prob",  # srt/layers/sampler.py:40 (flashinfer sampling backend only)
    "int8_scaled_mm",  # srt/layers/quantization/w8a8_int8.py:45, compressed_tensors_w8a8_int8.py:30
    "moe_sum",  # srt/layers/quantization/gguf.py:48
    "moe_sum_reduce",  # srt/layers/moe/moe_runner/triton_utils/fused_moe.py:59
)
globals().update({name: _not_provided(name) for name in _IMPORTED_NOT_PROVIDED})

PROVIDED = ("rmsnorm", "fused_add_rmsnorm", "silu_and_mul", "weak_ref_tensor", "is_arch_support_pdl")


class NotProvided(AttributeError, NotImplementedError):
    """An op this stand-in does not provide. An AttributeError too, so that ``hasattr`` and
    ``try: from sgl_kernel import op / except ImportError`` behave as with a build that lacks the op."""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise NotProvided(f"sgl_kernel.{name} {_WHY}")
