"""Where ``validate`` runs: the reference's torch device, ONNX Runtime's providers and the GPU kernels.

``--device cuda`` runs the reference (surrogate + threshold compaction) on the GPU in the bundle's dtype
(native bfloat16 / float16 there), ONNX Runtime on its CUDA provider when the installed build has one
(otherwise on the CPU, and the report says why), and the GPU kernels (Triton; the CUDA library of
``plugins/`` when it loads or builds) as validation backends compared exactly with the reference.

A :class:`Device` is plain data, so tests build one that runs this path on the CPU (Triton's interpreter,
``TRITON_INTERPRET=1``, runs the same kernels on CPU tensors).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvzap_export.errors import ConfigError

KERNEL_BACKENDS = ("triton", "cuda")


@dataclass
class Device:
    """kind: what the user asked (cpu | cuda); torch_device: where torch tensors of the reference and the
    kernels live; kernels: backend name -> implementation (``threshold_compaction`` / ``kv_compaction``
    with the contract of ``kvzap_export.ops``) or the reason it cannot run here."""

    kind: str
    torch_device: str = "cpu"
    ort_providers: tuple[str, ...] = ("CPUExecutionProvider",)
    ort_note: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    kernels: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "torch_device": self.torch_device, "onnxruntime_providers": list(self.ort_providers),
                **({"onnxruntime_note": self.ort_note} if self.ort_note else {}), **self.info,
                "kernels": {name: (k if isinstance(k, str) else "available") for name, k in self.kernels.items()}}


class TritonKernels:
    """The Triton kernels through their public, validated functions."""

    name = "triton"

    def threshold_compaction(self, scores, lengths, threshold, window, sink=0):
        from kvzap_export.kernels.triton_compaction import triton_threshold_compaction

        return triton_threshold_compaction(scores, lengths, threshold, window, sink)

    def kv_compaction(self, keys, values, indices):
        from kvzap_export.kernels.triton_compaction import triton_kv_compaction

        return triton_kv_compaction(keys, values, indices)


def triton_kernels(torch_device: str) -> Any:
    """TritonKernels, or why they cannot run on ``torch_device``."""
    try:
        from kvzap_export.kernels import triton_compaction
    except ModuleNotFoundError as exc:
        return f"the Triton kernels need {exc.name}: pip install 'kvzap-export[gpu]'"
    if triton_compaction.triton is None:
        return "triton is not installed: pip install 'kvzap-export[gpu]'"
    interpreted = not isinstance(triton_compaction.compaction_kernel_scalars, triton_compaction.triton.runtime.JITFunction)
    wanted = "cpu" if interpreted else "cuda"
    if torch.device(torch_device).type != wanted:
        return ("Triton runs interpreted (TRITON_INTERPRET=1) on CPU tensors only" if interpreted
                else "the compiled Triton kernels need a CUDA GPU (validate --device cuda)")
    return TritonKernels()


@functools.lru_cache(maxsize=1)
def _built_cuda_library() -> str:
    from kvzap_export.kernels.cuda_lib import build_kernel_library

    return str(build_kernel_library(Path(tempfile.mkdtemp(prefix="kvzap-kernels-")) / "libkvzap_kernels.so"))


def cuda_kernels(torch_device: str, library: str | None = None) -> Any:
    """The CUDA library's kernels (``library``, else ``$KVZAP_CUDA_LIB``, else built with nvcc from a source
    checkout), or why not."""
    library = library or os.environ.get("KVZAP_CUDA_LIB") or None
    if torch.device(torch_device).type != "cuda":
        return "the CUDA library runs on a CUDA GPU only (validate --device cuda)"
    from kvzap_export.errors import KvzapError
    from kvzap_export.kernels.cuda_lib import CudaKernels

    try:
        path = library or _built_cuda_library()
        return CudaKernels(path)
    except (KvzapError, RuntimeError, OSError) as exc:
        return f"the CUDA library could not be loaded or built: {str(exc).splitlines()[0]}"


def ort_providers(kind: str) -> tuple[tuple[str, ...], str | None]:
    """ONNX Runtime's providers for ``kind`` and, when they are not what was asked, why."""
    if kind != "cuda":
        return ("CPUExecutionProvider",), None
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        return ("CUDAExecutionProvider", "CPUExecutionProvider"), None
    return ("CPUExecutionProvider",), ("ONNX Runtime ran on the CPU: this onnxruntime build has no CUDAExecutionProvider "
                                       "(install onnxruntime-gpu for the CUDA provider)")


def _driver_version() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def gpu_info(index: int = 0) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(index)
    return {"gpu": torch.cuda.get_device_name(index), "compute_capability": f"{props.major}.{props.minor}",
            "driver": _driver_version(), "cuda": torch.version.cuda, "torch": torch.__version__}


def resolve_device(kind: str, cuda_library: str | None = None) -> Device:
    """The Device for ``--device``; ``cuda`` without a visible GPU is a one-line user error."""
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"--device {kind!r}: use cpu or cuda")
    if kind == "cpu":
        return Device("cpu", "cpu", info={"torch": torch.__version__})
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA GPU is visible to torch; use --device cpu")
    providers, note = ort_providers("cuda")
    return Device("cuda", "cuda", providers, note, gpu_info(),
                  {"triton": triton_kernels("cuda"), "cuda": cuda_kernels("cuda", cuda_library)})
