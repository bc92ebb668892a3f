"""kvzap-export's start-up stubs for SGLang 0.5.23 on the GPU machines without network (not part of SGLang).

The bundle that ``scripts/sglang_gpu/build_engine.py`` builds installs this file at the top of the site directory
that goes on PYTHONPATH, so every Python process there (SGLang's scheduler and detokenizer processes too) runs it at
start. It appends one finder to the END of ``sys.meta_path``: it answers only for the top-level names in ``STUBS``,
and only when no other finder found them (a real install always wins). What it gives is a placeholder module whose
attributes are placeholders; a placeholder called with one function (decorator use at import time) returns a
function that raises when called, and any other call raises ``NotImplementedError`` naming the placeholder.

Only names that SGLang imports unconditionally on the dense CUDA path and that the bundle does not carry are
stubbed. Never stubbed: names that transformers or torch probe with ``importlib.util.find_spec`` (torchcodec, av,
decord, kernels, dill, flashinfer, ...), since a stub would make them believe the package installed.

If another ``sitecustomize`` lies further along ``sys.path`` (the image's own), it is run after this one.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

# top-level name -> where SGLang 0.5.23 imports it on the dense CUDA path, and why a placeholder is enough there.
STUBS: dict[str, str] = {
    "cutlass": "sglang/kernels/ops/gemm/cutedsl_dual_gemm.py:36-42, imported by DualGemm (srt/layers/dual_gemm.py:40) "
               "when a Llama/Qwen2/Qwen3 MLP is built on CUDA; its kernel runs only on sm100 "
               "(can_use_dual_gemm: is_sm100_supported), so on an H200 nothing calls into it",
}

CREATED: list[str] = []  # the placeholder modules made in this process, for diagnostics


class Placeholder:
    """Stands for ``name`` inside a stubbed module; see the module docstring."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return Placeholder(f"{self._name}.{attribute}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            name, target = self._name, args[0]

            def unavailable(*_args, **_kwargs):
                raise NotImplementedError(f"{getattr(target, '__qualname__', target)} needs {name}, "
                                          f"a kvzap-export start-up placeholder (the package is not installed)")

            return unavailable
        raise NotImplementedError(f"{self._name} is a kvzap-export start-up placeholder (the package is not installed)")

    def __repr__(self) -> str:
        return f"<kvzap-export placeholder {self._name}>"


class PlaceholderModule(types.ModuleType):
    def __getattr__(self, attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return Placeholder(f"{self.__name__}.{attribute}")


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the modules of ``STUBS`` (and their submodules) when nothing before it on sys.meta_path did."""

    def __init__(self, names):
        self.names = frozenset(names)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] not in self.names:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = PlaceholderModule(spec.name)
        module.__path__ = []
        CREATED.append(spec.name)
        return module

    def exec_module(self, module):
        pass


def install() -> None:
    if not any(isinstance(finder, StubFinder) for finder in sys.meta_path):
        sys.meta_path.append(StubFinder(STUBS))


def _run_next_sitecustomize() -> None:
    """Runs the first other sitecustomize.py on sys.path after this file's directory, as Python would have."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(entry or os.getcwd())
        candidate = os.path.join(folder, "sitecustomize.py")
        if folder != here and os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_kvzap_next_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


install()
if __name__ == "sitecustomize":
    _run_next_sitecustomize()
