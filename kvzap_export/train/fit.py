"""Fitting the surrogate from (features, targets), one decoder layer at a time: ridge (linear) or an MLP.

Linear: sklearn's ``Ridge()`` (alpha 1, intercept), solved in closed form in float64, the Gram matrix
accumulated over row chunks so a layer's pairs are never copied whole in float64.
MLP: exact GELU, MSE, AdamW lr 5e-3, batch 512, cosine schedule, grad-norm clip 1.0, as kvpress's training
script, except: the validation rows (``train`` holds out every 8th training prompt, ``fit_mlp`` 5% of the pairs as
kvpress), the weight decay (0.1 by default; kvpress: AdamW's 0.01) and the targets, standardized per KV head while fitting (each head weighs the
same in the loss, as in the R² it is judged by) and folded back into the output layer, so the saved module
predicts log-scores directly, in kvpress's format.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvzap_export.surrogate.model import Surrogate, SurrogateConfig

CHUNK = 65_536  # rows per float64 block of the ridge Gram matrix


def ridge(x: torch.Tensor, y: torch.Tensor, alpha: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge regression with an unpenalized intercept. x: (N, D), y: (N, K) -> weight (K, D), bias (K,)."""
    x_mean = torch.zeros(x.shape[1], dtype=torch.float64)
    y_mean = y.double().mean(0)
    for start in range(0, len(x), CHUNK):
        x_mean += x[start:start + CHUNK].double().sum(0)
    x_mean /= len(x)
    gram = alpha * torch.eye(x.shape[1], dtype=torch.float64)
    cross = torch.zeros(x.shape[1], y.shape[1], dtype=torch.float64)
    for start in range(0, len(x), CHUNK):
        xc = x[start:start + CHUNK].double() - x_mean
        gram += xc.T @ xc
        cross += xc.T @ (y[start:start + CHUNK].double() - y_mean)
    weight = torch.linalg.solve(gram, cross).T  # (K, D)
    bias = y_mean - weight @ x_mean
    return weight.float(), bias.float()


def fit_linear_layer(x: torch.Tensor, y: torch.Tensor) -> nn.Linear:
    """One layer's linear surrogate. x: (N, D), y: (N, H) -> Linear(D, H)."""
    weight, bias = ridge(x, y)
    module = nn.Linear(x.shape[1], y.shape[1])
    with torch.no_grad():
        module.weight.copy_(weight)
        module.bias.copy_(bias)
    return module.eval()


def fit_mlp_layer(x: torch.Tensor, y: torch.Tensor, hidden_dim: int, val_idx: torch.Tensor, train_idx: torch.Tensor,
                  seed: int, epochs: int = 15, batch_size: int = 512, lr: float = 5e-3,
                  weight_decay: float = 0.1) -> tuple[nn.Sequential, float]:
    """One layer's MLP surrogate. x: (N, D) (any float dtype), y: (N, H) -> (module, validation MSE in log-score units).

    ``seed`` fixes the initialization and the epochs' shuffles, so a layer's fit does not depend on the others.
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    x = x.float().contiguous()
    y = y.float()
    mean, std = y[train_idx].mean(0), y[train_idx].std(0).clamp_min(1e-6)
    z = ((y - mean) / std).contiguous()
    module = nn.Sequential(nn.Linear(x.shape[1], hidden_dim), nn.GELU(), nn.Linear(hidden_dim, y.shape[1]))
    steps = epochs * max(1, (len(train_idx) + batch_size - 1) // batch_size)
    optim = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=weight_decay, fused=True)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=steps)
    for _ in range(epochs):
        perm = train_idx[torch.randperm(len(train_idx), generator=gen)]
        for start in range(0, len(perm), batch_size):
            batch = perm[start:start + batch_size]
            loss = nn.functional.mse_loss(module(x[batch]), z[batch])
            optim.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            optim.step()
            schedule.step()
    with torch.no_grad():  # fold the standardization into the output layer: predicts log-scores
        out = module[2]
        out.weight.mul_(std[:, None])
        out.bias.mul_(std).add_(mean)
        val = float(nn.functional.mse_loss(module(x[val_idx]), y[val_idx]))
    return module.eval(), val


def split(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(validation indices (5% of the pairs), training indices)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = max(1, n // 20)
    return order[:n_val], order[n_val:]


def layer_seed(seed: int, layer: int) -> int:
    return seed * 1009 + layer


def fit_linear(features: torch.Tensor, targets: torch.Tensor, on_layer: Callable[[int], None] | None = None) -> Surrogate:
    """features (N, L, D), targets (N, L, H) -> a linear Surrogate."""
    n, layers, dim = features.shape
    surrogate = Surrogate(SurrogateConfig(dim, targets.shape[-1], layers, None))
    for layer in range(layers):
        surrogate.layers[layer].load_state_dict(fit_linear_layer(features[:, layer], targets[:, layer]).state_dict())
        if on_layer:
            on_layer(layer)
    return surrogate.eval()


def fit_mlp(features: torch.Tensor, targets: torch.Tensor, hidden_dim: int, epochs: int = 15, batch_size: int = 512,
            lr: float = 5e-3, weight_decay: float = 0.1, seed: int = 0, on_layer: Callable[[int], None] | None = None) -> tuple[Surrogate, list[float]]:
    """features (N, L, D), targets (N, L, H) -> (MLP Surrogate, validation MSE per layer)."""
    n, layers, dim = features.shape
    surrogate = Surrogate(SurrogateConfig(dim, targets.shape[-1], layers, hidden_dim))
    val_idx, train_idx = split(n, seed)
    val_losses = []
    for layer in range(layers):
        module, val = fit_mlp_layer(features[:, layer], targets[:, layer], hidden_dim, val_idx, train_idx,
                                    layer_seed(seed, layer), epochs, batch_size, lr, weight_decay)
        surrogate.layers[layer].load_state_dict(module.state_dict())
        val_losses.append(val)
        if on_layer:
            on_layer(layer)
    return surrogate.eval(), val_losses
