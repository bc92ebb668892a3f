"""One runner contract for the PyTorch reference, ONNX Runtime and TensorRT (after Polygraphy's).

Public methods check; subclasses fill the small ``*_impl`` methods. Runners are context managers
and map ``{input_name: ndarray}`` to ``{output_name: ndarray}``, so ``validate`` treats every
backend alike. A contract test runs every runner class through the same checks.
"""

from __future__ import annotations

import abc
import time
from types import TracebackType

import numpy as np

from kvzap_export.errors import InputError

# name -> (numpy dtype name, shape with str for symbolic dims)
Metadata = dict[str, tuple[str, list]]


class Runner(abc.ABC):
    """Base of every backend runner."""

    backend: str = "base"

    def __init__(self, name: str):
        self.name = name
        self.is_active = False
        self.inference_time: float | None = None

    # -- what subclasses implement ------------------------------------------------------
    @abc.abstractmethod
    def activate_impl(self) -> None: ...

    @abc.abstractmethod
    def get_input_metadata_impl(self) -> Metadata: ...

    @abc.abstractmethod
    def infer_impl(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def deactivate_impl(self) -> None:
        pass

    # -- the contract ---------------------------------------------------------------------
    def activate(self) -> None:
        if not self.is_active:
            self.activate_impl()
            self.is_active = True

    def deactivate(self) -> None:
        if self.is_active:
            self.deactivate_impl()
            self.is_active = False

    def get_input_metadata(self) -> Metadata:
        self._require_active()
        return self.get_input_metadata_impl()

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Checks names, dtypes and ranks against the metadata, runs, records ``inference_time``."""
        self._require_active()
        meta = self.get_input_metadata_impl()
        missing = sorted(set(meta) - set(feed))
        extra = sorted(set(feed) - set(meta))
        if missing or extra:
            raise InputError(f"runner {self.name}: inputs {sorted(feed)} do not match the graph's {sorted(meta)}")
        for key, (dtype, shape) in meta.items():
            value = np.asarray(feed[key])
            if str(value.dtype) != dtype:
                raise InputError(f"runner {self.name}: input {key} has dtype {value.dtype}, expected {dtype}")
            if value.ndim != len(shape) or any(isinstance(d, int) and d != n for d, n in zip(shape, value.shape)):
                raise InputError(f"runner {self.name}: input {key} has shape {list(value.shape)}, expected {shape}")
        start = time.perf_counter()
        outputs = self.infer_impl(feed)
        self.inference_time = time.perf_counter() - start
        return outputs

    def _require_active(self) -> None:
        if not self.is_active:
            raise RuntimeError(f"runner {self.name} is not active; use it as a context manager")

    def __enter__(self) -> "Runner":
        self.activate()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.deactivate()
