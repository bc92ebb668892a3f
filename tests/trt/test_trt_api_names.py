"""Every TensorRT name the project uses exists in TensorRT 11's real Python API.

The real ``tensorrt-cu13-bindings`` wheel (1.3 MB, from the package registry) holds the whole binding's
names as strings inside ``tensorrt.so`` and the pure-Python ``tensorrt.plugin`` package. No TensorRT is
installed or mocked: the project's source is read with ``ast`` and each name looked up in those files.

Names checked: every attribute chain rooted at ``trt`` / ``trtp`` (``import tensorrt as trt``,
``import tensorrt.plugin as trtp``), and every attribute used on a value derived from them (``builder =
trt.Builder(...)`` then ``builder.create_network``; ``self.engine = runtime.deserialize_cuda_engine(...)``
then ``self.engine.num_io_tensors``...), followed through assignments in each function.
"""

import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

WHEEL = "tensorrt-cu13-bindings==11.4.0.106"
CACHE = Path.home() / ".cache" / "kvzap-export-tests" / "tensorrt-bindings"
PACKAGE = Path(__file__).resolve().parents[2] / "kvzap_export"
ROOTS = {"tensorrt": "trt", "tensorrt.plugin": "trtp"}


@pytest.fixture(scope="module")
def api():
    CACHE.mkdir(parents=True, exist_ok=True)
    wheels = list(CACHE.glob("tensorrt_cu13_bindings-11.4.0.106-*.whl"))
    if not wheels:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", WHEEL, "--no-deps", "-d", str(CACHE)],
                              capture_output=True, text=True, timeout=600)
        wheels = list(CACHE.glob("tensorrt_cu13_bindings-11.4.0.106-*.whl"))
        if not wheels:
            pytest.skip(f"could not download {WHEEL} from the package registry: {done.stderr.strip()[-300:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        binary = next(wheel.read(n) for n in wheel.namelist() if re.search(r"/tensorrt[^/]*\.so$", n))
        plugin_source = "\n".join(wheel.read(n).decode() for n in wheel.namelist() if "/plugin/" in n and n.endswith(".py"))
    return binary, plugin_source


def _root_aliases(tree: ast.AST) -> dict[str, str]:
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in ROOTS:
                    aliases[alias.asname or alias.name] = ROOTS[alias.name]
    return aliases


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` -> ["a", "b", "c"]; ``f(x).y`` -> chain of f plus "()" markers."""
    parts = []
    while True:
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Name):
            parts.append(node.id)
            return parts[::-1]
        else:
            return None


def _used_names(path: Path) -> set[tuple[str, str]]:
    """(root kind, name) for every attribute reached from TensorRT objects in one module."""
    tree = ast.parse(path.read_text())
    aliases = _root_aliases(tree)
    if not aliases:
        return set()
    used: set[tuple[str, str]] = set()
    for scope in [tree, *[n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]]:
        derived = dict(aliases)  # dotted name -> root kind
        derived.update({f"self.{k}": v for k, v in _self_attributes(tree, aliases).items()})
        assignments = sorted((n for n in _walk_scope(scope) if isinstance(n, ast.Assign)), key=lambda n: (n.lineno, n.col_offset))
        for node in assignments:  # in source order: builder before config = builder.create_builder_config()
            if isinstance(node, ast.Assign):
                value = _chain(node.value)
                kind = _derived_kind(value, derived)
                for target in node.targets:
                    names = target.elts if isinstance(target, ast.Tuple) else [target]
                    for name in names:
                        chain = _chain(name)
                        if kind and chain:
                            derived[".".join(chain)] = kind
        for node in _walk_scope(scope):
            if isinstance(node, ast.Attribute):
                chain = _chain(node)
                if not chain:
                    continue
                for cut in range(len(chain) - 1, 0, -1):
                    kind = derived.get(".".join(chain[:cut]))
                    if kind:
                        used.update((kind, part) for part in chain[cut:])
                        break
    return used


def _walk_scope(scope: ast.AST):
    """Nodes of one scope: nested functions are scopes of their own (their locals do not leak out)."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def _derived_kind(chain: list[str] | None, derived: dict[str, str]) -> str | None:
    if not chain:
        return None
    for cut in range(len(chain), 0, -1):
        kind = derived.get(".".join(chain[:cut]))
        if kind:
            return kind
    return None


def _self_attributes(tree: ast.AST, aliases: dict[str, str]) -> dict[str, str]:
    """``self.x = <TensorRT-derived>`` anywhere in a class: ``self.x`` is TensorRT-derived everywhere."""
    found: dict[str, str] = {}
    derived = dict(aliases)
    for _ in range(3):  # chains such as self.trt -> self.engine -> self.context
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = _chain(node.targets[0])
                kind = _derived_kind(_chain(node.value), {**derived, **{f"self.{k}": v for k, v in found.items()}})
                if target and target[0] == "self" and len(target) == 2 and kind:
                    found[target[1]] = kind
                elif target and len(target) == 1 and kind:  # locals that feed self attributes (runtime -> engine)
                    derived[target[0]] = kind
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.value, ast.Call):
                chain = _chain(node.value.func)
                if chain and chain[-1] == "import_tensorrt":  # our lazy importer returns the module
                    target = _chain(node.targets[0])
                    if target and target[0] == "self":
                        found[target[1]] = "trt"
                    elif target:
                        derived[".".join(target)] = "trt"
    return found


def project_names() -> dict[tuple[str, str], list[str]]:
    names: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for item in _used_names(path):
            names.setdefault(item, []).append(str(path.relative_to(PACKAGE.parent)))
    return names


def _exists(kind: str, name: str, binary: bytes, plugin_source: str) -> bool:
    if name == "__version__":
        return True
    in_plugin = re.search(rf"\b(def|class)\s+{re.escape(name)}\b|\b{re.escape(name)}\s*=|\.{re.escape(name)}\b", plugin_source)
    if kind == "trtp":
        return bool(in_plugin)
    # The linker merges string tails ("Builder" may live inside "IBuilder\0"): match NUL-terminated suffixes.
    return re.search(re.escape(name.encode()) + rb"\x00", binary) is not None or bool(in_plugin)


def test_the_scan_finds_the_project_s_tensorrt_usage():
    names = {name for _, name in project_names()}
    # The builder, the runner and the QDP plugin all reach TensorRT: the scan must see each of them.
    assert {"Builder", "create_network", "STRONGLY_TYPED", "parse_from_file", "build_serialized_network",
            "deserialize_cuda_engine", "execute_async_v3", "register", "aot_impl", "KernelLaunchParams"} <= names


def test_every_tensorrt_name_exists_in_tensorrt_11(api):
    binary, plugin_source = api
    missing = sorted(f"{kind}.{name} ({', '.join(sorted(set(files)))})" for (kind, name), files in project_names().items()
                     if not _exists(kind, name, binary, plugin_source))
    assert not missing, "names not in TensorRT 11.4's Python API:\n" + "\n".join(missing)


def test_the_check_rejects_names_that_do_not_exist(api):
    binary, plugin_source = api
    assert not _exists("trt", "BuilderFlagFP17", binary, plugin_source)
    assert not _exists("trtp", "quantum_impl", binary, plugin_source)
    assert _exists("trt", "OnnxParser", binary, plugin_source) and _exists("trtp", "aot_impl", binary, plugin_source)
