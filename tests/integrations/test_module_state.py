"""No module of ``kvzap_export/integrations/`` keeps mutable state at module level, except the process-wide singletons
an engine's plugin contract forces, each listed here with its reason and documented where it is defined.

The scan reads the source (``ast``; nothing is imported) of every module and finds, at module level (including
inside module-level ``if`` / ``try`` / ``with`` blocks):

- an assignment of a mutable value: a list, dict or set display or comprehension, or a call (only ``frozenset``,
  ``tuple``, ``MappingProxyType`` and ``logging.getLogger`` count as constants; any other call may build mutable
  state);
- a name some function of the module rebinds (``global NAME``), whatever its first value;
- a function memoised for the process (``functools.cache`` / ``lru_cache``);
- a mutable value assigned in the body of a module-level class (shared by every instance; a dataclass ``field(...)``
  gives each instance its own).

``__all__`` is module metadata, not state. Per-step and per-process state belongs to an object the engine hands to
our hooks (the runtime, the attention backend, ``RaggedParts``, the KV tree), never to a module.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "kvzap_export" / "integrations"

# "path relative to kvzap_export/integrations:name" -> why an engine's contract forces a process-wide singleton there
SINGLETONS = {
    "sglang/plugin.py:_CONFIG": "SGLang calls load_plugin once per process and every hook as a plain function: "
                                "the settings install() read (and ragged mode's RaggedParts) are reached from there",
    "sglang/plugin.py:_RUNTIME": "the runtime the plain-function hooks share, built at the first hook call from "
                                 "_CONFIG (everything else a hook needs hangs off it)",
    "sglang/plugin.py:_readings_only": "the allocator readings of a process where the plugin runs without KVzap: the "
                                       "dense hooks have no runtime to hang them on",
    "host_reads.py:tallies": "the host-read tallies of the process (a test probe): counted wraps methods the engine "
                             "reaches through plain-function hooks, the step-end hook takes them",
    "trtllm/process.py:STATE": "TensorRT-LLM builds the compression manager and attention modules itself from an "
                               "algorithm name: what install() set up is reached from there",
}

CONSTANT_CALLS = {"frozenset", "tuple", "MappingProxyType", "getLogger"}
CACHES = {"cache", "lru_cache"}


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _mutable(value: ast.expr | None) -> bool:
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    return isinstance(value, ast.Call) and _callee(value) not in CONSTANT_CALLS


def _assigned(statement: ast.stmt) -> list[tuple[str, ast.expr | None]]:
    """(name, value) of each plain name an assignment statement binds."""
    if isinstance(statement, ast.Assign):
        targets, value = statement.targets, statement.value
    elif isinstance(statement, (ast.AnnAssign, ast.AugAssign)):
        targets, value = [statement.target], statement.value
    else:
        return []
    names = [n for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    return [(n.id, value) for n in names]


def _module_level(body: list[ast.stmt]):
    """The module's statements, with those of module-level compound statements (not function or class bodies)."""
    for statement in body:
        yield statement
        if isinstance(statement, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for inner in getattr(statement, field, []):
                    yield from _module_level(inner.body if isinstance(inner, ast.ExceptHandler) else [inner])


def module_state(source: str) -> set[str]:
    """Names of the module-level mutable state one module's source defines (the module docstring's rules)."""
    tree = ast.parse(source)
    found = {n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names}
    for statement in _module_level(tree.body):
        found.update(name for name, value in _assigned(statement) if name != "__all__" and _mutable(value))
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            decorators = [d.func if isinstance(d, ast.Call) else d for d in statement.decorator_list]
            if any((d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "")) in CACHES for d in decorators):
                found.add(statement.name)
        if isinstance(statement, ast.ClassDef):
            found.update(f"{statement.name}.{name}" for inner in statement.body for name, value in _assigned(inner)
                         if _mutable(value) and not (isinstance(value, ast.Call) and _callee(value) == "field"))
    return found


def package_state(package: Path = PACKAGE) -> set[str]:
    return {f"{path.relative_to(package).as_posix()}:{name}" for path in sorted(package.rglob("*.py"))
            for name in module_state(path.read_text())}


def test_module_level_state_is_only_the_listed_singletons():
    found = package_state()
    new, gone = sorted(found - set(SINGLETONS)), sorted(set(SINGLETONS) - found)
    assert not new, ("module-level mutable state outside the plugin-contract singletons (give it an owner the "
                     f"engine hands to the hooks, or list it in SINGLETONS with the contract that forces it): {new}")
    assert not gone, f"listed singletons that no longer exist (drop them from SINGLETONS): {gone}"


def test_every_singleton_says_so_where_it_is_defined():
    """A comment above the definition, or the function's docstring, calls it a process-wide singleton."""
    for key in SINGLETONS:
        path, name = key.split(":")
        source = (PACKAGE / path).read_text()
        lines = source.splitlines()
        at = next(i for i, line in enumerate(lines)
                  if line.startswith((f"{name} ", f"{name}:", f"{name}=", f"def {name}(")))
        context = "\n".join(lines[max(0, at - 8): at + 6])
        assert "singleton" in context, f"{key}: no 'singleton' note at its definition"


def test_the_scan_finds_each_kind_of_module_state():
    source = '''
import functools
import logging
from dataclasses import dataclass, field
from types import MappingProxyType

log = logging.getLogger(__name__)
LIMIT = 3
NAMES = ("a", "b")
FROZEN = frozenset({1, 2})
TABLE = MappingProxyType({"a": 1})
__all__ = ["LIMIT"]
CACHE = {}
SEEN: set = set()
ITEMS = [1, 2]
STORE = Store()
_CURRENT = None
if True:
    HELD = {k: 1 for k in "ab"}
try:
    import triton
except ModuleNotFoundError:
    triton = None


def set_current(value):
    global _CURRENT
    _CURRENT = value


@functools.cache
def made_once():
    return object()


@functools.lru_cache(maxsize=None)
def memo(x):
    return x


@dataclass
class Pool:
    shared = []
    size = 4
    own: dict = field(default_factory=dict)

    def method(self):
        local = {}
        return local
'''
    assert module_state(source) == {"CACHE", "SEEN", "ITEMS", "STORE", "_CURRENT", "HELD", "made_once", "memo",
                                    "Pool.shared"}
