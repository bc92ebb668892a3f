"""Output comparison (after Polygraphy's compare functions): factories returning judged results."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class OutputComparison:
    output: str
    max_abs_error: float
    max_rel_error: float
    mean_abs_error: float
    mismatches: int
    passed: bool
    detail: str = ""

    def __bool__(self) -> bool:
        return self.passed


def simple(atol: float, rtol: float):
    """Float outputs: pass when ``|got - ref| <= atol + rtol * |ref|`` everywhere (NaN must match NaN)."""

    def compare(name: str, ref: np.ndarray, got: np.ndarray) -> OutputComparison:
        if ref.shape != got.shape:
            return OutputComparison(name, float("inf"), float("inf"), float("inf"), -1, False, f"shape {got.shape} != {ref.shape}")
        ref64, got64 = ref.astype(np.float64), got.astype(np.float64)
        nan_mismatch = np.isnan(ref64) != np.isnan(got64)
        both = ~np.isnan(ref64) & ~np.isnan(got64)
        same_inf = np.isinf(ref64) & (ref64 == got64)
        diff = np.where(both & ~same_inf, np.abs(got64 - ref64), 0.0)
        bad = nan_mismatch | (diff > atol + rtol * np.abs(np.where(both, ref64, 0.0)))
        rel = diff / np.maximum(np.abs(np.where(both, ref64, 1.0)), 1e-30)
        return OutputComparison(name, float(diff.max(initial=0.0)), float(np.where(both & ~same_inf, rel, 0.0).max(initial=0.0)),
                                float(diff.mean()) if diff.size else 0.0, int(bad.sum()), not bad.any())

    return compare


def exact():
    """Integer and boolean outputs (decisions, counts, indices): every element equal."""

    def compare(name: str, ref: np.ndarray, got: np.ndarray) -> OutputComparison:
        if ref.shape != got.shape:
            return OutputComparison(name, float("inf"), float("inf"), float("inf"), -1, False, f"shape {got.shape} != {ref.shape}")
        bad = ref != got
        diff = np.abs(ref.astype(np.float64) - got.astype(np.float64))
        return OutputComparison(name, float(diff.max(initial=0.0)), 0.0, float(diff.mean()) if diff.size else 0.0, int(bad.sum()), not bad.any())

    return compare


def compare_outputs(ref: dict[str, np.ndarray], got: dict[str, np.ndarray], float_compare, int_compare=None) -> list[OutputComparison]:
    int_compare = int_compare or exact()
    results = []
    for name, ref_value in ref.items():
        if name not in got:
            results.append(OutputComparison(name, float("inf"), float("inf"), float("inf"), -1, False, "output missing"))
            continue
        fn = float_compare if np.issubdtype(ref_value.dtype, np.floating) else int_compare
        results.append(fn(name, ref_value, got[name]))
    return results
