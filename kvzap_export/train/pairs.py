"""Cached (feature, target) pairs, read a span of decoder layers at a time.

Every layer's features of half a million positions do not fit in memory (SmolLM2: 30 layers x 576 x 2 bytes
= 35 KB per position, 17 GB for 500k), one layer's do (0.6 GB). Training therefore reads the cache in
passes of as many layers as fit in a share of the memory this process can still use (MemAvailable, capped by
its cgroup's limit) and fits those layers before the next pass. Each cache file holds ``features`` (n, L, D)
float16 and ``targets`` (n, L, H) float32.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from kvzap_export.train.data import Prompt

MEMORY_SHARE = 0.5  # of the available memory, for one pass (its pairs and one layer's float32 copy while it is fitted)

Pairs = tuple[torch.Tensor, torch.Tensor]  # features (n, layers, D) float16, targets (n, layers, H) float32


def shapes(done: list[tuple[Prompt, Path]]) -> tuple[list[int], int, int, int, int]:
    """(positions of each training file, evaluation positions, layers, hidden size, KV heads), from the files' headers."""
    from safetensors import safe_open

    train, n_test = [], 0
    for prompt, path in done:
        with safe_open(str(path), framework="pt") as f:
            (n, layers, dim), heads = f.get_slice("features").get_shape(), f.get_slice("targets").get_shape()[-1]
        if prompt.test:
            n_test += n
        else:
            train.append(n)
    return train, n_test, layers, dim, heads


def prompt_split(counts: list[int], every: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(validation rows, training rows) of the training pairs: the rows of every ``every``-th training prompt
    (from the fourth) are validation, so the validation text is never trained on, not just its positions."""
    rows = torch.arange(sum(counts))
    is_val = torch.cat([torch.full((n,), i % every == 3) for i, n in enumerate(counts)]) if counts else torch.zeros(0, dtype=torch.bool)
    if not is_val.any() or is_val.all():  # too few prompts to keep one back: validate on 5% of the pairs
        from kvzap_export.train.fit import split

        val, train = split(len(rows), 0)
        return val.sort().values, train.sort().values
    return rows[is_val], rows[~is_val]


def pass_bytes(n_train: int, n_test: int, layers: int, dim: int, heads: int) -> int:
    """Peak bytes of a pass of ``layers`` layers: their pairs (the evaluation ones twice while they are gathered)
    and one layer's training features in float32 while it is fitted."""
    return (n_train + 2 * n_test) * layers * (dim * 2 + heads * 4) + n_train * dim * 4


def layers_per_pass(n_train: int, n_test: int, layers: int, dim: int, heads: int, memory: int | None) -> int:
    """How many layers one pass holds within MEMORY_SHARE of ``memory`` (all of them when it is unknown; at least one)."""
    if memory is None:
        return layers
    fit = [span for span in range(1, layers + 1) if pass_bytes(n_train, n_test, span, dim, heads) <= MEMORY_SHARE * memory]
    return fit[-1] if fit else 1


def read_layers(done: list[tuple[Prompt, Path]], start: int, stop: int, n_train: int,
                on_file: Callable[[], None] | None = None) -> tuple[Pairs, dict[str, Pairs]]:
    """Layers ``start:stop`` of every file: the training pairs in one preallocated tensor, evaluation pairs per domain."""
    from safetensors import safe_open

    train_x = train_y = None
    tests: dict[str, tuple[list, list]] = {}
    row = 0
    for prompt, path in done:
        with safe_open(str(path), framework="pt") as f:
            x, y = f.get_slice("features")[:, start:stop], f.get_slice("targets")[:, start:stop]
        if prompt.test:
            tests.setdefault(prompt.domain, ([], []))[0].append(x)
            tests[prompt.domain][1].append(y)
        else:
            if train_x is None:
                train_x = torch.empty(n_train, *x.shape[1:], dtype=torch.float16)
                train_y = torch.empty(n_train, *y.shape[1:])
            train_x[row:row + len(x)], train_y[row:row + len(x)] = x, y
            row += len(x)
        if on_file:
            on_file()
    return (train_x, train_y), {k: (torch.cat(xs), torch.cat(ys)) for k, (xs, ys) in tests.items()}
