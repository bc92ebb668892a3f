"""Lets the registry's torchvision import beside CPU torch, for SGLang's CPU engine environment.

A test-environment aid, not part of kvzap-export, loaded only by the engine environment that
``scripts/sglang_cpu_env.sh`` makes (one ``import`` line in its .pth file). SGLang 0.5.23 imports
torchvision whatever the model (``sglang/srt/configs/__init__.py`` -> ``nano_nemotron_vl`` ->
``multimodal/internvl_utils.py``). The registry's torchvision 0.28.0 (the build paired with torch 2.13.0) is a
CUDA build: its C extension cannot load with CPU torch, after which ``torchvision/_meta_registrations.py``
registers fake kernels for ``torchvision::nms`` and ``torchvision::qnms`` and fails because those operators
do not exist. Defining the two schemas first (no kernel: calling them raises) lets the import finish; nothing
on the dense-attention path calls them. Nothing happens until something imports torchvision.
"""

from __future__ import annotations

import importlib.abc
import sys

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBRARY = None  # torch keeps a definition only while its Library object lives


def define_missing_ops() -> None:
    global _LIBRARY
    import torch

    missing = [name for name in _SCHEMAS if not torch._C._dispatch_has_kernel(f"torchvision::{name}")
               and not _has_schema(torch, name)]
    if missing:
        _LIBRARY = torch.library.Library("torchvision", "FRAGMENT")
        for name in missing:
            _LIBRARY.define(_SCHEMAS[name])


def _has_schema(torch, name: str) -> bool:
    try:
        torch._C._get_schema(f"torchvision::{name}", "")
        return True
    except RuntimeError:
        return False


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Runs ``define_missing_ops`` once, just before the first ``import torchvision``; then steps aside."""

    def find_spec(self, fullname, path, target=None):
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            define_missing_ops()
        return None


def install() -> None:
    if not any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())
