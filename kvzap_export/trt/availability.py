"""Can TensorRT be used on this machine? One place that imports it and says why not, in one line."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from kvzap_export.errors import ConfigError

INSTALL = "pip install tensorrt (from NVIDIA's package index), on a machine with an NVIDIA GPU"
BUILD_PLUGIN = "cmake -S plugins -B build -DTensorRT_ROOT=DIR && cmake --build build"
PLUGIN_LIB_ENV = "KVZAP_TRT_PLUGIN_LIB"

_loaded_plugin_libraries: set[str] = set()  # the registry refuses a library whose plugins are already registered


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


def load_plugin_libraries(trt, libraries) -> None:
    """Registers each plugin library (``--plugin-lib``) with TensorRT once per process."""
    registry = trt.get_plugin_registry()
    for library in libraries:
        path = Path(library).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"--plugin-lib {library}: no such file; build the plugin library with `{BUILD_PLUGIN}`")
        if str(path) in _loaded_plugin_libraries:
            continue
        if registry.load_library(str(path)) is None:
            raise ConfigError(f"--plugin-lib {library}: TensorRT could not load it (see the TensorRT log above)")
        _loaded_plugin_libraries.add(str(path))
