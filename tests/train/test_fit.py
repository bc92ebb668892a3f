"""Fitting and reporting: ridge matches the closed form, the MLP learns, R² behaves."""

import torch

from kvzap_export.train.fit import fit_linear, fit_mlp, ridge
from kvzap_export.train.report import predict, r2_per_head


def test_ridge_matches_numpy_closed_form():
    import numpy as np

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(200, 6, generator=gen), torch.randn(200, 2, generator=gen)
    weight, bias = ridge(x, y, alpha=1.0)
    xa, ya = x.double().numpy(), y.double().numpy()
    xc, yc = xa - xa.mean(0), ya - ya.mean(0)
    w = np.linalg.solve(xc.T @ xc + np.eye(6), xc.T @ yc)
    np.testing.assert_allclose(weight.numpy(), w.T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bias.numpy(), ya.mean(0) - xa.mean(0) @ w, rtol=1e-5, atol=1e-6)


def test_linear_and_mlp_recover_a_learnable_target():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3000, 2, 16, generator=gen)
    true_w = torch.randn(2, 16, 3, generator=gen)
    y = torch.einsum("nld,ldh->nlh", x, true_w) + 0.05 * torch.randn(3000, 2, 3, generator=gen)
    linear = fit_linear(x[:2500], y[:2500])
    mlp, val = fit_mlp(x[:2500], y[:2500], hidden_dim=32, epochs=60, batch_size=128)
    r2_lin = r2_per_head(predict(linear, x[2500:]), y[2500:])
    r2_mlp = r2_per_head(predict(mlp, x[2500:]), y[2500:])
    assert r2_lin.shape == (2, 3) and r2_lin.min() > 0.99
    assert r2_mlp.min() > 0.8 and all(v < 1.0 for v in val)


def test_mlp_predicts_in_the_targets_units_after_standardized_fitting():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3000, 1, 8, generator=gen)
    y = 40.0 * torch.tanh(x[..., :3]) - 25.0 + 0.1 * torch.randn(3000, 1, 3, generator=gen)  # large scale, offset
    mlp, val = fit_mlp(x[:2500], y[:2500], hidden_dim=32, epochs=40, batch_size=128)
    pred = predict(mlp, x[2500:])
    assert r2_per_head(pred, y[2500:]).min() > 0.9
    assert (pred - y[2500:]).abs().mean() < 0.25 * y.std()  # folded back: log-score units, not standardized ones
    assert val[0] < 0.1 * float(y.var())


def test_ridge_in_chunks_equals_one_block(monkeypatch):
    from kvzap_export.train import fit

    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(1000, 5, generator=gen).half(), torch.randn(1000, 2, generator=gen)
    whole = ridge(x, y)
    monkeypatch.setattr(fit, "CHUNK", 64)
    chunked = ridge(x, y)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(whole, chunked, strict=True))


def test_layers_per_pass_fills_the_memory_share():
    from kvzap_export.train.pairs import MEMORY_SHARE, layers_per_pass, pass_bytes

    assert pass_bytes(1000, 100, 7, 16, 2) == (1000 + 200) * 7 * (16 * 2 + 2 * 4) + 1000 * 16 * 4
    memory = int(pass_bytes(1000, 100, 7, 16, 2) / MEMORY_SHARE) + 1
    assert layers_per_pass(1000, 100, 30, 16, 2, memory) == 7
    assert layers_per_pass(1000, 100, 5, 16, 2, memory) == 5
    assert layers_per_pass(1000, 100, 30, 16, 2, 10) == 1  # too little memory: one layer at a time (the run checked it fits)
    assert layers_per_pass(1000, 100, 30, 16, 2, None) == 30  # unknown: every layer in one pass


def test_r2_of_perfect_and_useless_predictors():
    gen = torch.Generator().manual_seed(2)
    t = torch.randn(500, 2, 3, generator=gen)
    assert torch.allclose(r2_per_head(t * 2 + 1, t), torch.ones(2, 3))
    assert r2_per_head(torch.randn(500, 2, 3, generator=gen), t).max() < 0.05
