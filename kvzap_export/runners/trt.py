"""TensorRT runner (TensorRT 10.x / 11.x Python API), for bundles whose engines were built.

TensorRT is imported lazily and only here; without it, constructing the runner raises
``MissingDependencyError``. Buffers are torch CUDA tensors, so no pycuda/cuda-python is needed.
This runner has never executed on the machines this project is developed on (no TensorRT there);
its API names are checked against the real TensorRT 11 bindings in tests/trt/test_trt_api_names.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvzap_export.errors import InputError, MissingDependencyError
from kvzap_export.export.dtypes import TORCH_DTYPES
from kvzap_export.runners.base import Metadata, Runner
from kvzap_export.trt.availability import import_tensorrt, load_plugin_libraries

# TensorRT DataType member -> the project's dtype name (export/dtypes.py). numpy has no bfloat16: BF16 inputs are
# fed as float32 and cast on the device, BF16 outputs come back widened to float32 (exact).
_DTYPE_OF_TRT = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT32": "int32", "INT64": "int64", "BOOL": "bool"}


def _numpy_name(dtype: str) -> str:
    return "float32" if dtype == "bfloat16" else dtype


class TrtRunner(Runner):
    """Deserializes an engine plan and runs it with ``execute_async_v3`` on the current CUDA stream.

    plugin_libraries: shared libraries registering the plugins the engine uses (the compaction plugin,
    ``plugins/``), loaded before deserializing. host_code_allowed: the engine carries host code (a
    version-compatible build embeds its lean runtime and any serialized plugin library); TensorRT refuses
    such an engine unless the runtime allows it, so set it only for engines this toolkit built.
    """

    backend = "trt"
    device = "cuda"  # where buffers live; TensorRT reads and writes them there

    def __init__(self, engine_path: str | Path, name: str | None = None, plugin_libraries: tuple[str, ...] = (),
                 host_code_allowed: bool = False):
        super().__init__(name or f"trt:{Path(engine_path).name}")
        self.engine_path = Path(engine_path)
        self.plugin_libraries = tuple(plugin_libraries)
        self.host_code_allowed = host_code_allowed
        trt, why_not = import_tensorrt()
        if trt is None:
            raise MissingDependencyError(why_not)
        self.trt = trt
        self.runtime = None
        self.engine = None
        self.context = None

    @classmethod
    def for_artifact(cls, bundle: str | Path, manifest: dict, source: str,
                     plugin_libraries: tuple[str, ...] = ()) -> "TrtRunner | None":
        """The runner of the engine ``kvzap-export build`` made from the artifact ``source``, or None.

        Version-compatible engines (``manifest["engines"]["version_compatible"]``) are allowed their host code.
        """
        path = next((a["path"] for a in manifest["artifacts"] if a["kind"] == "trt_engine" and a.get("source") == source), None)
        if path is None:
            return None
        compatible = bool((manifest.get("engines") or {}).get("version_compatible"))
        return cls(Path(bundle) / path, plugin_libraries=plugin_libraries, host_code_allowed=compatible)

    def activate_impl(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise MissingDependencyError("TensorRT engines need a CUDA GPU; none is visible to torch")
        trt = self.trt
        logger = trt.Logger(trt.Logger.WARNING)
        load_plugin_libraries(trt, self.plugin_libraries)
        self.runtime = runtime = trt.Runtime(logger)  # kept: the engine must not outlive its runtime
        if self.host_code_allowed:
            runtime.engine_host_code_allowed = True
        self.engine = runtime.deserialize_cuda_engine(self.engine_path.read_bytes())
        if self.engine is None:
            raise MissingDependencyError(f"{self.engine_path}: TensorRT could not deserialize this engine (built for another version or GPU?)")
        self.context = self.engine.create_execution_context()

    def _io_names(self, mode) -> list[str]:
        engine = self.engine
        return [engine.get_tensor_name(i) for i in range(engine.num_io_tensors) if engine.get_tensor_mode(engine.get_tensor_name(i)) == mode]

    def _dtype(self, name: str) -> str:
        trt_name = self.engine.get_tensor_dtype(name).name
        if trt_name not in _DTYPE_OF_TRT:
            raise RuntimeError(f"{self.engine_path}: tensor {name} has TensorRT type {trt_name}, which this runner does not read")
        return _DTYPE_OF_TRT[trt_name]

    def get_input_metadata_impl(self) -> Metadata:
        meta = {}
        for name in self._io_names(self.trt.TensorIOMode.INPUT):
            shape = [d if d >= 0 else f"dim{i}" for i, d in enumerate(self.engine.get_tensor_shape(name))]
            meta[name] = (_numpy_name(self._dtype(name)), shape)
        return meta

    def infer_impl(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        stream = torch.cuda.current_stream()
        keep_alive = []
        for name, array in feed.items():
            # np.array keeps 0-d inputs (threshold, window) 0-d; np.ascontiguousarray would make them shape (1,).
            tensor = torch.from_numpy(np.array(array, order="C")).to(self.device, TORCH_DTYPES[self._dtype(name)])
            keep_alive.append(tensor)
            if not self.context.set_input_shape(name, tuple(tensor.shape)):
                raise InputError(f"runner {self.name}: TensorRT refused input {name} of shape {list(tensor.shape)}; the "
                                 f"engine takes {list(self.engine.get_tensor_shape(name))} (-1: within its optimization "
                                 "profile; rebuild with larger --max-batch / --max-seq to go further)")
            if not self.context.set_tensor_address(name, tensor.data_ptr()):
                raise RuntimeError(f"TensorRT refused the address of input {name} for {self.engine_path}")
        outputs = {}
        for name in self._io_names(self.trt.TensorIOMode.OUTPUT):
            shape = tuple(self.context.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise RuntimeError(f"TensorRT left output {name} of {self.engine_path} without a shape ({list(shape)})")
            out = torch.empty(shape, dtype=TORCH_DTYPES[self._dtype(name)], device=self.device)
            if not self.context.set_tensor_address(name, out.data_ptr()):
                raise RuntimeError(f"TensorRT refused the address of output {name} for {self.engine_path}")
            outputs[name] = out
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError(f"TensorRT execution failed for {self.engine_path}")
        stream.synchronize()
        return {k: (v.float() if v.dtype == torch.bfloat16 else v).cpu().numpy() for k, v in outputs.items()}

    def deactivate_impl(self) -> None:
        self.context = None
        self.engine = None
        self.runtime = None
