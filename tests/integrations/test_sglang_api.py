"""Every SGLang name our glue uses exists in the real sglang==0.5.23 source, with the parameters we rely on.

The wheel is downloaded from the package registry (``pip download --no-deps``; pinned to one platform
tag so every CI machine reads the same file), cached under pytest's cache directory, never installed:
its Python sources are read straight from the zip and parsed with ``ast``. The list of names is
``kvzap_export.integrations.sglang.SGLANG_API`` (one place). Skips only when the registry is unreachable.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvzap_export.integrations import sglang as glue

WHEEL_TAGS = ["--python-version", "3.11", "--platform", "manylinux_2_34_x86_64", "--only-binary=:all:"]
UNREACHABLE = re.compile(r"NewConnectionError|Temporary failure in name resolution|Network is unreachable|"
                         r"Connection refused|ConnectTimeout|ReadTimeout|Max retries exceeded|No route to host|"
                         r"Could not fetch URL|ProxyError|SSLError", re.IGNORECASE)


@pytest.fixture(scope="module")
def wheel() -> zipfile.ZipFile:
    # Outside pytest's own cache so it also works with -p no:cacheprovider (and survives `pytest --cache-clear`).
    cache = Path.home() / ".cache" / "kvzap-export-tests" / f"sglang-{glue.SGLANG_VERSION}-wheel"
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(f"sglang-{glue.SGLANG_VERSION}-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", f"sglang=={glue.SGLANG_VERSION}", "--no-deps", *WHEEL_TAGS,
               "--disable-pip-version-check", "-q", "-d", str(cache)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        output = done.stdout + done.stderr
        if done.returncode != 0:
            if UNREACHABLE.search(output):
                pytest.skip(f"package registry unreachable, cannot download sglang=={glue.SGLANG_VERSION}: "
                            f"{output.strip().splitlines()[-1]}")
            pytest.fail(f"pip download sglang=={glue.SGLANG_VERSION} failed:\n{output}")
        found = sorted(cache.glob(f"sglang-{glue.SGLANG_VERSION}-*.whl"))
    assert found, f"no sglang {glue.SGLANG_VERSION} wheel in {cache}"
    with zipfile.ZipFile(found[0]) as zf:
        yield zf


class Source:
    """Parsed modules of the wheel, by dotted name."""

    def __init__(self, zf: zipfile.ZipFile):
        self.zf, self.trees = zf, {}
        self.names = set(zf.namelist())

    def tree(self, module: str) -> ast.Module | None:
        if module not in self.trees:
            base = module.replace(".", "/")
            path = next((p for p in (f"{base}.py", f"{base}/__init__.py") if p in self.names), None)
            self.trees[module] = None if path is None else ast.parse(self.zf.read(path).decode("utf-8"), filename=path)
        return self.trees[module]


def top_level(tree: ast.Module, name: str):
    """The module-level definition binding ``name`` (def, class, assignment or import), or None."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return node
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name.split(".")[0]) == name for a in node.names):
            return node
    return None


def class_chain(tree: ast.Module, name: str) -> list[ast.ClassDef]:
    """The class and its bases defined in the same module (nearest first)."""
    chain, todo = [], [name]
    while todo:
        node = top_level(tree, todo.pop(0))
        if isinstance(node, ast.ClassDef) and node not in chain:
            chain.append(node)
            todo += [b.id for b in node.bases if isinstance(b, ast.Name)]
    return chain


def has_field(cls: ast.ClassDef, name: str) -> bool:
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name) and t.value.id == "self":
                return True
    return False


def param_names(fn: ast.FunctionDef) -> list[str]:
    return [a.arg for a in fn.args.posonlyargs + fn.args.args]


def problem(source: Source, api: glue.ApiName) -> str | None:
    tree = source.tree(api.module)
    if tree is None:
        return f"module {api.module} not found"
    parts = api.qualname.split(".")
    if api.kind in ("name", "function", "class"):
        node = top_level(tree, parts[0])
        if node is None:
            return f"{api.module} defines no {parts[0]}"
        if api.kind == "class" and not isinstance(node, ast.ClassDef):
            return f"{api.target} is not a class"
        if api.kind == "function":
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return f"{api.target} is not a function"
            got = param_names(node)
            if got[: len(api.params)] != list(api.params):
                return f"{api.target} parameters {got}, expected to start with {list(api.params)}"
        return None
    chain = class_chain(tree, parts[0])
    if not chain:
        return f"{api.module} defines no class {parts[0]}"
    if api.kind == "field":
        return None if any(has_field(c, parts[1]) for c in chain) else f"{api.target}: no such field or attribute"
    for cls in chain:
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == parts[1]:
                got = param_names(node)
                if got[: len(api.params)] != list(api.params):
                    return f"{api.target} parameters {got}, expected to start with {list(api.params)}"
                return None
    return f"{api.target}: no such method"


def test_every_sglang_name_exists_with_our_signature(wheel):
    source = Source(wheel)
    problems = [p for p in (problem(source, a) for a in glue.SGLANG_API) if p]
    assert not problems, "SGLang API drift:\n" + "\n".join(problems)


def test_glue_uses_only_listed_names():
    """Hook targets are looked up in SGLANG_API; a name missing from the list would fail at install time."""
    text = Path(glue.__file__).read_text()
    used = set(re.findall(r'\bapi\("([^"]+)"\)', text)) | set(glue.SCORED_ATTENTION)
    listed = {a.qualname for a in glue.SGLANG_API}
    assert used and used <= listed, used - listed
    assert len(listed) == len(glue.SGLANG_API), "duplicate qualnames in SGLANG_API"


def test_checker_catches_drift(wheel):
    """The checker itself: renamed members, wrong parameters and missing modules are reported."""
    source = Source(wheel)
    bad = [
        glue.ApiName("sglang.srt.managers.scheduler", "Scheduler.process_batch_results", "method", ("self",)),
        glue.ApiName("sglang.srt.models.llama", "LlamaAttention.forward", "method", ("self", "hidden_states")),
        glue.ApiName("sglang.srt.models.no_such_model", "X", "class"),
        glue.ApiName("sglang.srt.model_executor.forward_batch_info", "ForwardBatch.no_such_field", "field"),
    ]
    assert all(problem(source, a) for a in bad)
