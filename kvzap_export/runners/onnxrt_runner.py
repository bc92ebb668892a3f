"""ONNX Runtime runner (CPU provider by default)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvzap_export.runners.base import Metadata, Runner

_NP_OF_ORT = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(bfloat16)": "bfloat16",
              "tensor(int32)": "int32", "tensor(int64)": "int64", "tensor(bool)": "bool"}


class OnnxrtRunner(Runner):
    """Runs an ONNX file on ONNX Runtime (``providers``: CPU by default); ``custom_ops`` registers our plugin-node
    kernels; ``threads`` caps intra-op threads (None: ORT's default, one per core).

    ``bf16_emulation`` runs a bfloat16 graph through :func:`emulate_bf16` (ORT CPU has no bfloat16
    kernels); the runner then takes and returns float32 arrays holding bfloat16 values.
    """

    backend = "onnxrt"

    def __init__(self, path: str | Path, name: str | None = None, custom_ops: bool = False, bf16_emulation: bool = False,
                 providers: tuple[str, ...] = ("CPUExecutionProvider",), threads: int | None = None):
        super().__init__(name or f"onnxrt{'-bf16emu' if bf16_emulation else ''}:{Path(path).name}")
        self.path = Path(path)
        self.custom_ops = custom_ops
        self.bf16_emulation = bf16_emulation
        self.providers = tuple(providers)
        self.threads = threads
        if bf16_emulation:
            self.backend = "onnxrt-bf16emu"
        self.session = None
        self.providers_used: tuple[str, ...] = ()

    def activate_impl(self) -> None:
        from kvzap_export.runners.onnxrt import ort_session

        source: str | bytes = str(self.path)
        if self.bf16_emulation:
            import onnx

            from kvzap_export.runners.bf16_emulation import emulate_bf16

            source = emulate_bf16(onnx.load(str(self.path))).SerializeToString()
        self.session = ort_session(source, custom_ops=self.custom_ops, threads=self.threads, providers=self.providers)
        self.providers_used = tuple(self.session.get_providers())  # what ran, read from the session

    def get_input_metadata_impl(self) -> Metadata:
        return {i.name: (_NP_OF_ORT.get(i.type, i.type), list(i.shape)) for i in self.session.get_inputs()}

    def infer_impl(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = [o.name for o in self.session.get_outputs()]
        return dict(zip(names, self.session.run(names, feed)))

    def deactivate_impl(self) -> None:
        self.session = None
