"""Can TensorRT be used on this machine? One place that imports it and says why not, in one line."""

from __future__ import annotations

from types import ModuleType

INSTALL = "pip install tensorrt (from NVIDIA's package index), on a machine with an NVIDIA GPU"


def import_tensorrt() -> tuple[ModuleType | None, str | None]:
    """``(tensorrt, None)``, or ``(None, reason)`` when it is absent or cannot load its libraries."""
    try:
        import tensorrt as trt
    except ModuleNotFoundError as exc:
        if exc.name == "tensorrt":
            return None, f"TensorRT is not installed ({INSTALL})"
        return None, f"TensorRT is installed but incomplete (no module {exc.name!r}); reinstall it: {INSTALL}"
    except ImportError as exc:  # e.g. the bindings wheel alone, without libnvinfer
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return None, f"TensorRT's Python bindings are installed but cannot load ({first}); {INSTALL}"
    return trt, None


def tensorrt_status() -> str | None:
    """None when engines can be built here; otherwise why not, in one line."""
    trt, why_not = import_tensorrt()
    if trt is None:
        return why_not
    import torch

    if not torch.cuda.is_available():
        return f"TensorRT {trt.__version__} is installed but no CUDA GPU is visible to torch"
    return None


def gpu_name() -> str | None:
    """Name of CUDA device 0 as torch reports it (what the manifest records), or None without a GPU."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
