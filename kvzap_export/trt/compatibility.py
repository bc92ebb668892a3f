"""Do a bundle's TensorRT engines fit this machine? Engines are tied to a TensorRT version and a GPU.

``kvzap-export verify`` adds these findings to the bundle's own (``bundle.verify``, which checks the files and
needs no TensorRT): the check runs only where TensorRT is importable, and says so in a note otherwise.
"""

from __future__ import annotations

from kvzap_export.trt.availability import gpu_name, import_tensorrt


def engine_compatibility(manifest: dict) -> tuple[list[str], list[str]]:
    """(problems, notes) of the manifest's ``trt_engine`` artifacts on this machine; both empty without engines.

    A problem: an engine built with another TensorRT version (unless version-compatible) or for another GPU
    (unless built with hardware compatibility). A note: what could not be checked here, and why.
    """
    engines = [a for a in manifest.get("artifacts", []) if a.get("kind") == "trt_engine"]
    problems: list[str] = []
    notes: list[str] = []
    if not engines:
        return problems, notes
    built = manifest.get("engines") or {}
    recorded = built.get("tensorrt") or manifest.get("tools", {}).get("tensorrt")
    trt, why_not = import_tensorrt()
    if trt is None:
        notes.append(f"{len(engines)} TensorRT engine(s) not checked against this machine: {why_not}")
        return problems, notes
    if recorded and trt.__version__ != recorded:
        message = f"engines were built with TensorRT {recorded}, this machine has {trt.__version__}"
        if built.get("version_compatible"):
            notes.append(f"{message} (version-compatible engines: a later TensorRT can run them)")
        else:
            problems.append(f"{message}; rebuild with `kvzap-export build`")
    gpu, here = built.get("gpu"), gpu_name()
    if gpu and here is None:
        notes.append(f"engines were built for GPU {gpu!r}; no CUDA GPU is visible here, so the GPU was not checked")
    elif gpu and here != gpu:
        message = f"engines were built for GPU {gpu!r}, this machine has {here!r}"
        if built.get("hardware_compat") in ("ampere+", "same"):
            notes.append(f"{message} (built with hardware compatibility {built['hardware_compat']!r})")
        else:
            problems.append(f"{message}; rebuild with `kvzap-export build`")
    return problems, notes
