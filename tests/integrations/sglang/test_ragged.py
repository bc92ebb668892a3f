"""Ragged mode's τ from a pruned fraction (``KVZAP_PRUNED_FRACTION``, a benchmark setting for dummy weights)."""

import pytest
import torch

from kvzap_export.integrations.sglang.ragged import QUANTILE_MAX, fraction_threshold


def test_the_fraction_sets_tau_past_torchs_quantile_limit():
    """A 64k prompt on Llama-3.1-8B has more scores than torch.quantile takes: evenly spaced ones stand for them."""
    n = QUANTILE_MAX + QUANTILE_MAX // 2
    scores = torch.arange(n, dtype=torch.float32)
    scores[n - 2 ** 20:] = float("nan")  # the window's positions: not tested
    with pytest.raises(RuntimeError):
        torch.nanquantile(scores, 0.7)
    tested = n - 2 ** 20
    assert fraction_threshold(scores, 0.7) == pytest.approx(0.7 * tested, rel=1e-3)
    assert fraction_threshold(torch.tensor([3.0, float("nan"), 1.0, 2.0]), 0.5) == 2.0


def test_no_tested_score_sets_no_tau():
    assert fraction_threshold(torch.full((7,), float("nan")), 0.4) is None
