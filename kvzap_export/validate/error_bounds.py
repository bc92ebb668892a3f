"""How far a correct surrogate computation may be from the exact result: a float64 reference and a bound per
element, derived from the computation (its dtype, its reduction lengths, its operands' magnitudes).

Why: two correct float32 computations of one layer (PyTorch on a GPU, ONNX Runtime on a CPU) sum their dot
products in different orders and differ by a few tens of float32 ulps where the output is large, and by far more
than 1e-5 of the output where the output cancels to near zero. A fixed ``atol``/``rtol`` either fails such
correct pairs (it did: 4.6e-5 on three SmolLM2 layers at 1e-5) or, loosened, lets real errors through. Here
each computation is compared with the exact result (float64 from the same operands), within a bound that grows
where rounding can really move the result.

The model of rounding (Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 3; the probabilistic
form of Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019):

- float32 arithmetic (the bundle's dtype is float32): a dot product of ``n`` terms ``t_i`` (products, plus the
  bias) summed in any order makes ``n`` additions, each with relative error ``|delta| <= u`` (u = 2^-24) of its
  partial sum. Treating the deltas as independent and mean zero, the error's standard deviation is
  ``u * sqrt(sum_k s_k^2 / 3)`` over the partial sums ``s_k``; in recursive summation (the worst common order:
  blocked, pairwise and tiled orders have fewer or shorter partial sums) ``sum_k s_k^2`` is about
  ``n * (|t|_2^2 / 2 + S^2 / 3)`` (S the sum: a random walk plus its drift), so the *unit*
  ``U = u * sqrt(n) * sqrt(|t|_2^2 + S^2)`` is at least 2.4 standard deviations. Errors of the hidden layer
  reach the output through the second layer's weights and GELU's slope (at most 1.13), added in quadrature
  (independent across hidden units), with GELU's own rounding (a few ulps). The bound is ``LAMBDA`` = 8 units
  (about 20 standard deviations): measured on the shipped SmolLM2 surrogates, every pair of sequential,
  reversed, BLAS (numpy, ONNX Runtime) orders stays under 1 unit (tests/validate/test_error_bounds.py), and a
  bias 1e-3 off exceeds the bound.
- bfloat16 / float16 bundles (u_d = 2^-8 / 2^-11): the reference and the backend both take the operands rounded
  to that dtype and accumulate in float32, then round each node's output (the hidden pre-activation, the GELU
  output, the scores) to the dtype, or fuse nodes and round less, or round the product before adding its bias
  (a graph that does not fuse the bias). Those roundings dominate; they are bounded deterministically (first
  order, no probability): ``|dz| <= u_d (|z| + |xW|) + float32 part``, ``|dh| <= 1.13 |dz| + u_d |h|``,
  ``|dy| <= sum_j |W2_j| |dh_j| + u_d (|y| + |hW2|) + float32 part``.

Compaction is not concerned: its outputs are integers and booleans, compared exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvzap_export.export.dtypes import TORCH_DTYPES

LAMBDA = 8.0
GELU_SLOPE = 1.13  # max |d/dx x*Phi(x)| = 1.1289 at x = sqrt(2)
GELU_ULPS = 4.0  # a float32 erf-based GELU's own error, in units of u * |output|
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}


@dataclass
class Bounded:
    """The exact outputs (float64) and, per element, how far a correct computation in ``dtype`` may be from them."""

    reference: np.ndarray
    bound: np.ndarray
    dtype: str

    def describe(self) -> dict:
        """The bound in a report: its model and its size on these inputs."""
        model = ("float32: 8 units u*sqrt(n)*sqrt(|t|^2+S^2) per dot product (n: reduction length), in quadrature "
                 "through the layers" if self.dtype == "float32" else
                 f"{self.dtype}: each node output (and each product before its bias) rounded to {self.dtype} "
                 f"(u = {UNIT_ROUNDOFF[self.dtype]:.3g}), first-order worst case through the layers, plus the float32 "
                 "accumulation's 8 units")
        return {"model": model, "lambda": LAMBDA, "unit_roundoff": UNIT_ROUNDOFF[self.dtype],
                "bound_min": float(self.bound.min(initial=np.inf)),
                "bound_median": float(np.median(self.bound)) if self.bound.size else 0.0,
                "bound_max": float(self.bound.max(initial=0.0))}


def _operand(tensor: torch.Tensor, dtype: str) -> np.ndarray:
    """float64 copy of ``tensor`` rounded to ``dtype`` first (what both computations receive)."""
    if dtype != "float32":
        tensor = tensor.to(TORCH_DTYPES[dtype])
    return tensor.double().numpy()  # exact widening from any of the three dtypes


def _affine(weight: np.ndarray, bias: np.ndarray, x: np.ndarray, u32: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [T, n] @ weight[m, n]^T + bias in float64, the float32 summation unit U [T, m] of each output, and |x @ W^T|
    (the product before the bias: a graph that does not fuse the bias rounds it on its own)."""
    product = x @ weight.T
    exact = product + bias
    squares = (x * x) @ (weight * weight).T + bias * bias  # |t|_2^2 over the n products and the bias
    n = weight.shape[1] + 1
    return exact, u32 * np.sqrt(n) * np.sqrt(squares + exact * exact), np.abs(product)


def _gelu(z: np.ndarray) -> np.ndarray:
    return torch.nn.functional.gelu(torch.from_numpy(z)).numpy()


def reference_and_bound(module: torch.nn.Module, hidden_states: np.ndarray | torch.Tensor, dtype: str) -> Bounded:
    """The exact (float64) scores of one surrogate layer (``nn.Linear`` or ``Linear, GELU, Linear``, kvpress's
    layouts) on ``hidden_states`` [T, D], and the bound per score for a correct computation in ``dtype``
    (float32, float16, bfloat16; weights and inputs rounded to it first, as kvpress casts them)."""
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"no error model for dtype {dtype!r}; expected one of {sorted(UNIT_ROUNDOFF)}")
    u32, ud = UNIT_ROUNDOFF["float32"], UNIT_ROUNDOFF[dtype]
    low = dtype != "float32"
    x = _operand(torch.as_tensor(np.asarray(hidden_states, dtype=np.float32)), dtype)
    linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
    params = [(_operand(m.weight.detach().cpu(), dtype), _operand(m.bias.detach().cpu(), dtype)) for m in linears]
    (w1, b1) = params[0]
    z, unit_z, product_z = _affine(w1, b1, x, u32)
    if len(params) == 1:  # linear variant: one dot product per score
        err = LAMBDA * unit_z + (ud * (np.abs(z) + product_z) if low else 0.0)
        return Bounded(z, err, dtype)
    if len(params) != 2:
        raise ValueError(f"a surrogate layer is Linear or Linear-GELU-Linear, got {len(params)} Linear modules")
    (w2, b2) = params[1]
    if low:  # node outputs rounded to the dtype (the product before its bias too): first-order worst case
        err_z = ud * (np.abs(z) + product_z) + LAMBDA * unit_z
        h = _gelu(z)
        err_h = GELU_SLOPE * err_z + ud * np.abs(h)
        y, unit_y, product_y = _affine(w2, b2, h, u32)
        err = err_h @ np.abs(w2).T + ud * (np.abs(y) + product_y) + LAMBDA * unit_y
        return Bounded(y, err, dtype)
    h = _gelu(z)
    y, unit_y, _ = _affine(w2, b2, h, u32)
    hidden_units = (GELU_SLOPE * unit_z) ** 2 + (GELU_ULPS * u32 * h) ** 2  # [T, hidden], each in units
    units = np.sqrt(hidden_units @ (w2 * w2).T + unit_y**2)
    return Bounded(y, LAMBDA * units, dtype)


def within(got: np.ndarray, bounded: Bounded) -> dict:
    """How ``got`` compares with the exact outputs: passed, mismatches, max abs error, and the largest error as a
    fraction of its bound (``bound_used``: 1.0 means at the bound). NaN anywhere is a failure."""
    got64 = np.asarray(got, dtype=np.float64)
    if got64.shape != bounded.reference.shape:
        return {"passed": False, "mismatches": -1, "max_abs_error": float("inf"), "bound_used": float("inf"),
                "detail": f"shape {list(got64.shape)} != {list(bounded.reference.shape)}"}
    diff = np.abs(got64 - bounded.reference)
    bad = ~(diff <= bounded.bound)  # NaN compares false: a failure
    used = np.where(bounded.bound > 0, diff / np.maximum(bounded.bound, 1e-300), np.where(diff > 0, np.inf, 0.0))
    return {"passed": not bad.any(), "mismatches": int(bad.sum()), "max_abs_error": float(np.nanmax(diff, initial=0.0)),
            "bound_used": float(np.nanmax(used, initial=0.0)) if not np.isnan(used).any() else float("inf")}
