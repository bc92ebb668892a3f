"""The PyTorch reference as a runner: any callable over torch tensors, with declared I/O."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvzap_export.runners.base import Metadata, Runner


class TorchRunner(Runner):
    """Runs ``fn(**inputs) -> tuple | dict`` on the CPU (or ``device``) and returns numpy outputs.

    We do not use Polygraphy's PyTorch runner: it moves inputs to CUDA unconditionally.
    """

    backend = "torch"

    def __init__(self, fn: Callable, input_metadata: Metadata, output_names: list[str], name: str = "torch", device: str = "cpu"):
        super().__init__(name)
        self.fn = fn
        self.metadata = input_metadata
        self.output_names = list(output_names)
        self.device = device

    def activate_impl(self) -> None:
        pass

    def get_input_metadata_impl(self) -> Metadata:
        return self.metadata

    def infer_impl(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        tensors = {}
        for key, value in feed.items():
            array = np.asarray(value)
            tensors[key] = torch.from_numpy(array.copy()).to(self.device)
        with torch.no_grad():
            result = self.fn(**tensors)
        if isinstance(result, torch.Tensor):
            result = (result,)
        if isinstance(result, dict):
            result = tuple(result[k] for k in self.output_names)
        return {name: _to_numpy(t) for name, t in zip(self.output_names, result)}


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: compare in float32 (exact widening)
        t = t.float()
    return t.numpy()
