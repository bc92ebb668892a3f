"""Run in the SGLang environment (``$KVZAP_SGLANG_PYTHON``) with ``scripts/sglang_gpu`` first on PYTHONPATH: compares
each op of the CUDA stand-in for sgl-kernel with SGLang 0.5.23's own torch implementation of the same layer
(``RMSNorm.forward_native``, ``SiluAndMul.forward_native``), on CPU tensors, float32 and bfloat16.

Prints one JSON object: ``standin`` (the sgl_kernel file used), ``cases`` (name -> error ratio, max |a - b| /
(atol + rtol |b|): at most 1 means equal within the dtype's tolerance) and ``power`` (name -> the same ratio for a
deliberately wrong reference: a 10x epsilon, swapped SiLU halves, a residual left unchanged; each must exceed 1, or
the comparison could not have failed). Used by ``test_standin_ops.py``.
"""

from __future__ import annotations

import json

import torch

import sgl_kernel
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.layernorm import RMSNorm

TOLERANCE = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (1e-3, 2 ** -6)}  # (atol, rtol)


def ratio(got: torch.Tensor, want: torch.Tensor) -> float:
    atol, rtol = TOLERANCE[want.dtype]
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    return ((got.double() - want.double()).abs() / (atol + rtol * want.double().abs())).max().item()


def rows(tokens: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows spanning 1e-3 to 10 in scale: where mean(x**2) is near eps, a wrong eps shows."""
    return (torch.randn(tokens, hidden) * torch.logspace(-3, 1, tokens)[:, None]).to(dtype)


def norm_layer(hidden: int, eps: float, dtype: torch.dtype) -> RMSNorm:
    layer = RMSNorm(hidden, eps=eps).to(dtype)
    layer.weight.data.uniform_(0.5, 1.5)
    return layer


def main() -> None:
    torch.manual_seed(0)
    cases, power = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for hidden, eps in ((64, 1e-6), (128, 1e-5)):
            layer, x, residual = norm_layer(hidden, eps, dtype), rows(9, hidden, dtype), rows(9, hidden, dtype)
            weight = layer.weight.data
            key = f"{name}_h{hidden}"
            cases[f"rmsnorm_{key}"] = ratio(sgl_kernel.rmsnorm(x, weight, eps), layer.forward_native(x))
            out = torch.empty_like(x)
            returned = sgl_kernel.rmsnorm(x, weight, eps, out=out)
            cases[f"rmsnorm_out_{key}"] = ratio(out, layer.forward_native(x)) if returned is out else float("inf")

            got_x, got_residual = x.clone(), residual.clone()
            assert sgl_kernel.fused_add_rmsnorm(got_x, got_residual, weight, eps) is None
            want_x, want_residual = layer.forward_native(x.clone(), residual.clone())
            cases[f"fused_add_rmsnorm_out_{key}"] = ratio(got_x, want_x)
            cases[f"fused_add_rmsnorm_residual_{key}"] = ratio(got_residual, want_residual)

            # Qwen3's q/k norm without the JIT kernel: per head, [tokens, heads, head_dim] flattened by forward_cuda.
            heads = x.reshape(3, 3, hidden)
            cases[f"rmsnorm_per_head_{key}"] = ratio(sgl_kernel.rmsnorm(heads.reshape(-1, hidden), weight, eps)
                                                     .reshape(heads.shape), layer.forward_native(heads))
            if dtype == torch.float32:
                wrong = norm_layer(hidden, 10 * eps, dtype)
                wrong.weight.data.copy_(weight)
                power[f"rmsnorm_eps_x10_{key}"] = ratio(sgl_kernel.rmsnorm(x, weight, eps), wrong.forward_native(x))
                power[f"fused_add_rmsnorm_residual_unchanged_{key}"] = ratio(residual, want_residual)

        act = SiluAndMul()
        for width in ((100, 128) if dtype == torch.bfloat16 else (102, 128)):  # rows of 16-byte multiples
            gate_up = torch.randn(7, 2 * width, dtype=dtype) * 3
            want = act.forward_native(gate_up)
            cases[f"silu_and_mul_{name}_w{width}"] = ratio(sgl_kernel.silu_and_mul(gate_up), want)
            out = torch.empty(7, width, dtype=dtype)
            returned = sgl_kernel.silu_and_mul(gate_up, out)
            cases[f"silu_and_mul_out_{name}_w{width}"] = ratio(out, want) if returned is out else float("inf")
            swapped = torch.cat([gate_up[:, width:], gate_up[:, :width]], dim=-1)
            power[f"silu_and_mul_swapped_halves_{name}_w{width}"] = ratio(sgl_kernel.silu_and_mul(gate_up),
                                                                         act.forward_native(swapped))
    print(json.dumps({"standin": sgl_kernel.__file__, "cases": cases, "power": power}))


if __name__ == "__main__":
    main()
