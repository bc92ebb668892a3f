"""Operator-level parity: each exported surrogate layer in ONNX Runtime vs the PyTorch reference.

Inputs use token counts that differ from the export sample (3), including 1, so an axis frozen
by accident shows up as an error rather than a silent pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from kvzap_export.export.dtypes import TORCH_DTYPES
from kvzap_export.surrogate.model import Surrogate

TOKEN_COUNTS = (1, 7, 40)
# Max |ORT - torch| allowed, relative to max(1, |reference score|). fp32 is the contract (1e-5);
# reduced precision differs by accumulation order, so the bound is a few ulps of the dtype.
TOLERANCE = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}


@dataclass
class LayerCheck:
    layer: int
    max_abs_error: float
    max_rel_error: float
    passed: bool


def _ort_supports(dtype: str) -> str | None:
    """ONNX Runtime's CPU provider has no bfloat16 Gemm/MatMul kernels: such graphs cannot run there."""
    if dtype == "bfloat16":
        return "ONNX Runtime CPU has no bfloat16 Gemm kernel; run the bf16 graphs with TensorRT (kvzap-export build)"
    return None


def check_surrogate_layers(
    bundle: Path,
    artifacts: list[dict],
    surrogate: Surrogate,
    dtype: str,
    seed: int = 0,
    on_layer: Callable[[int], None] | None = None,
) -> dict:
    """Runs every ``surrogate_layer`` artifact in ORT on random hidden states; returns a summary."""
    skip = _ort_supports(dtype)
    layers = [a for a in artifacts if a["kind"] == "surrogate_layer"]
    if skip:
        return {"check": "surrogate_onnx_vs_torch", "status": "skipped", "reason": skip, "passed": None}
    import onnxruntime as ort

    generator = torch.Generator().manual_seed(seed)
    tol = TOLERANCE[dtype]
    torch_dtype = TORCH_DTYPES[dtype]
    options = ort.SessionOptions()
    options.log_severity_level = 3
    results = []
    for artifact in layers:
        session = ort.InferenceSession(str(bundle / artifact["path"]), options, providers=["CPUExecutionProvider"])
        worst_abs = worst_rel = 0.0
        ok = True
        for count in TOKEN_COUNTS:
            x = torch.randn(count, surrogate.config.input_dim, generator=generator).to(torch_dtype)
            with torch.no_grad():
                ref = surrogate.score(artifact["layer"], x).float().numpy()
            (got,) = session.run(None, {"hidden_states": x.numpy()})
            if got.shape != ref.shape:
                ok = False
                worst_abs = float("inf")
                continue
            err = np.abs(got.astype(np.float32) - ref)
            scale = np.maximum(1.0, np.abs(ref))
            worst_abs = max(worst_abs, float(err.max()))
            worst_rel = max(worst_rel, float((err / scale).max()))
            ok = ok and bool((err <= tol * scale).all())
        results.append(LayerCheck(artifact["layer"], worst_abs, worst_rel, ok))
        if on_layer is not None:
            on_layer(artifact["layer"])
    passed = all(r.passed for r in results)
    return {
        "check": "surrogate_onnx_vs_torch",
        "status": "passed" if passed else "failed",
        "passed": passed,
        "backend": "onnxruntime-cpu",
        "token_counts": list(TOKEN_COUNTS),
        "tolerance": f"|ort - torch| <= {tol:g} * max(1, |torch|)",
        "max_abs_error": max((r.max_abs_error for r in results), default=0.0),
        "max_rel_error": max((r.max_rel_error for r in results), default=0.0),
        "failed_layers": [r.layer for r in results if not r.passed],
        "layers": [asdict(r) for r in results],
    }
