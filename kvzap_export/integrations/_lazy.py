"""The one guarded import of a serving engine: a missing engine is one line, never a traceback."""

from __future__ import annotations

import importlib
from types import ModuleType

from kvzap_export.errors import MissingDependencyError


def import_engine(module: str, feature: str, install: str) -> ModuleType:
    """Imports ``module`` of an engine, or raises MissingDependencyError naming ``feature`` and ``install``.

    Only the engine's own absence is translated: an import error raised from inside an installed engine
    (a broken install, a missing dependency of the engine) keeps its traceback.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        root = module.split(".")[0]
        if exc.name is not None and (exc.name == root or module == exc.name or module.startswith(exc.name + ".")):
            raise MissingDependencyError(f"{feature} needs {root} (`import {module}` failed): {install}") from None
        raise
