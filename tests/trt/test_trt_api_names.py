"""Every TensorRT name the project uses exists in TensorRT 11's real Python API, and none that 11 removed is used.

The real ``tensorrt-cu13-bindings`` wheel (1.3 MB, from the package registry, cached in ~/.cache) holds the whole
binding's names as strings inside ``tensorrt.so`` and the pure-Python ``tensorrt.plugin`` package. No TensorRT is
installed or mocked: the project's source (all of ``kvzap_export/``) is read with ``ast`` and each name looked up
in those files.

Names checked: every attribute chain rooted at the TensorRT modules (``import tensorrt as trt``, ``import
tensorrt.plugin as trtp``, ``from tensorrt import ...``, the project's ``import_tensorrt()`` helpers, and the
names ``trt`` / ``trtp`` wherever they are bound, parameters included: the project's convention), ``getattr``
with a literal name on them, and every attribute used on a value derived from them, followed through
assignments, ``with ... as``, tuple unpacking, ``self.`` attributes, annotated parameters (``scores:
trtp.TensorDesc`` then ``scores.shape_expr``) and into nested functions. Limits: values passed through calls of
the project's own functions are not followed, and a name counts as present when the binary holds it as a string
(the linker merges string tails, so a suffix match counts); names TensorRT 11 removed but whose strings survive
elsewhere (``BuilderFlag.INT8`` next to ``DataType.INT8``) are caught by an explicit list instead.
"""

import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REQUIREMENT = "tensorrt-cu13-bindings==11.4.0.106"
WHEEL_GLOB = "tensorrt_cu13_bindings-11.4.0.106-*.whl"
CACHE = Path.home() / ".cache" / "kvzap-export-tests" / "tensorrt-bindings"
PACKAGE = Path(__file__).resolve().parents[2] / "kvzap_export"
MODULES = {"tensorrt": "trt", "tensorrt.plugin": "trtp"}
CONVENTION = {"trt": "trt", "trtp": "trtp"}  # what the project calls the two modules, wherever bound
IMPORTERS = {"import_tensorrt"}  # project helpers returning the module, alone or first in a tuple
NETWORK_ERRORS = ("NewConnectionError", "ConnectionError", "Max retries exceeded", "Temporary failure in name resolution",
                  "Name or service not known", "Network is unreachable", "Connection refused", "No route to host",
                  "timed out", "ProxyError", "SSLError")
# Removed by TensorRT 10/11 (weak typing, implicit batch, bindings API, calibrators) yet still present as strings in
# the binary for other reasons, or easy to reintroduce: never to be used.
REMOVED_QUALIFIED = {"BuilderFlag.FP16", "BuilderFlag.BF16", "BuilderFlag.INT8", "BuilderFlag.FP8", "BuilderFlag.INT4",
                     "BuilderFlag.OBEY_PRECISION_CONSTRAINTS", "BuilderFlag.PREFER_PRECISION_CONSTRAINTS",
                     "NetworkDefinitionCreationFlag.EXPLICIT_BATCH", "NetworkDefinitionCreationFlag.EXPLICIT_PRECISION"}
REMOVED_MEMBERS = {"platform_has_fast_fp16", "platform_has_fast_int8", "platform_has_tf32", "int8_calibrator",
                   "set_output_type", "precision", "build_engine", "build_cuda_engine", "execute_async", "execute_async_v2",
                   "max_workspace_size", "max_batch_size", "num_bindings", "get_binding_index", "get_binding_name",
                   "get_binding_shape", "get_binding_dtype", "binding_is_input", "set_binding_shape",
                   "IInt8EntropyCalibrator2", "IInt8MinMaxCalibrator"}


@pytest.fixture(scope="module")
def api() -> tuple[bytes, str]:
    """(tensorrt.so bytes, source of the tensorrt.plugin package) from the real wheel."""
    CACHE.mkdir(parents=True, exist_ok=True)
    wheels = sorted(CACHE.glob(WHEEL_GLOB))
    if not wheels:
        # One platform-independent choice: the names are the same in every cpXY wheel of this version.
        done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", REQUIREMENT, "--no-deps", "--only-binary=:all:",
                               "--python-version", "3.11", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                               "-d", str(CACHE)], capture_output=True, text=True, timeout=600)
        wheels = sorted(CACHE.glob(WHEEL_GLOB))
        if not wheels:
            if any(marker in done.stderr for marker in NETWORK_ERRORS):
                pytest.skip(f"the package registry is unreachable, {REQUIREMENT} could not be downloaded: {done.stderr.strip()[-300:]}")
            pytest.fail(f"`pip download {REQUIREMENT}` failed:\n{done.stderr[-2000:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        binary = next(wheel.read(n) for n in wheel.namelist() if re.search(r"/tensorrt[^/]*\.so$", n))
        plugin_source = "\n".join(wheel.read(n).decode() for n in wheel.namelist() if "/plugin/" in n and n.endswith(".py"))
    assert len(binary) > 500_000 and "def register" in plugin_source and "def aot_impl" in plugin_source
    return binary, plugin_source


# ---------------------------------------------------------------------------------------------------------------
# The scanner


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b(x)[0].c`` -> ["a", "b", "c"]: calls and subscripts are looked through."""
    parts = []
    while True:
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        elif isinstance(node, (ast.Call, ast.Subscript)):
            node = node.func if isinstance(node, ast.Call) else node.value
        elif isinstance(node, ast.Name):
            parts.append(node.id)
            return parts[::-1]
        else:
            return None


def _prefix_kind(chain: list[str] | None, derived: dict[str, str]) -> tuple[int, str] | None:
    """(length of the longest prefix of ``chain`` bound to a TensorRT value, its kind)."""
    for cut in range(len(chain or ()), 0, -1):
        kind = derived.get(".".join(chain[:cut]))
        if kind:
            return cut, kind
    return None


def _is_importer_call(node: ast.AST) -> bool:
    chain = _chain(node.func) if isinstance(node, ast.Call) else None
    return bool(chain) and chain[-1] in IMPORTERS


def _bind(targets: list[ast.AST], value: ast.AST | None, derived: dict[str, str]) -> None:
    """Marks assignment targets whose value is TensorRT-derived."""
    if value is None:
        return
    if _is_importer_call(value):
        kind, first_only = "trt", True
    else:
        found = _prefix_kind(_chain(value), derived)
        if not found:
            return
        kind, first_only = found[1], False
    for target in targets:
        names = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
        for name in names[:1] if first_only and len(names) > 1 else names:
            chain = _chain(name)
            if chain:
                derived[".".join(chain)] = kind


def _scope_nodes(scope: ast.AST):
    """Nodes of one scope; nested functions, lambdas and classes are scopes of their own."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


class _Scanner:
    def __init__(self) -> None:
        self.names: set[tuple[str, str]] = set()  # (kind, attribute name)
        self.qualified: set[tuple[str, str]] = set()  # (kind, "Enum.MEMBER") rooted at a module

    def scope(self, scope: ast.AST, inherited: dict[str, str], roots: set[str]) -> None:
        derived = dict(inherited)
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            arguments = scope.args
            for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg, arguments.kwarg]:
                if arg is None:
                    continue
                if arg.arg in CONVENTION:
                    derived[arg.arg] = CONVENTION[arg.arg]
                elif arg.annotation is not None:
                    for node in ast.walk(arg.annotation):  # scores: trtp.TensorDesc, outputs: Tuple[trtp.Tensor]
                        found = _prefix_kind(_chain(node), derived) if isinstance(node, ast.Attribute) else None
                        if found:
                            derived[arg.arg] = found[1]
        nodes = list(_scope_nodes(scope))
        bindings = [n for n in nodes if isinstance(n, (ast.Assign, ast.AnnAssign, ast.NamedExpr, ast.withitem))]
        for node in sorted(bindings, key=lambda n: (getattr(n, "lineno", 0) or getattr(n.context_expr, "lineno", 0),
                                                     getattr(n, "col_offset", 0))):
            if isinstance(node, ast.Assign):
                _bind(node.targets, node.value, derived)
            elif isinstance(node, ast.AnnAssign):
                _bind([node.target], node.value, derived)
            elif isinstance(node, ast.NamedExpr):
                _bind([node.target], node.value, derived)
            elif node.optional_vars is not None:
                _bind([node.optional_vars], node.context_expr, derived)
        for node in nodes:
            if isinstance(node, ast.Attribute):
                self._attribute(_chain(node), derived, roots)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                chain = _chain(node.args[0])
                if chain:
                    self._attribute([*chain, node.args[1].value], derived, roots)
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                self.scope(node, derived, roots)

    def _attribute(self, chain: list[str] | None, derived: dict[str, str], roots: set[str]) -> None:
        found = _prefix_kind(chain, derived)
        if not found:
            return
        cut, kind = found
        self.names.update((kind, part) for part in chain[cut:])
        if ".".join(chain[:cut]) in roots and len(chain) > cut:
            self.qualified.add((kind, ".".join(chain[cut:])))


def _module_roots(tree: ast.AST) -> dict[str, str]:
    """Names bound to the TensorRT modules by imports, plus the project's convention."""
    roots = dict(CONVENTION)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    roots[alias.asname or alias.name] = MODULES[alias.name]
        elif isinstance(node, ast.ImportFrom) and node.module in MODULES:
            for alias in node.names:
                if node.module == "tensorrt" and alias.name == "plugin":
                    roots[alias.asname or alias.name] = "trtp"
                else:  # from tensorrt import Builder: the name itself is used, and is a TensorRT value
                    roots[alias.asname or alias.name] = MODULES[node.module] + "-value:" + alias.name
    return roots


def _self_attributes(tree: ast.AST, derived: dict[str, str]) -> dict[str, str]:
    """``self.x = <TensorRT-derived>`` anywhere in a module: ``self.x`` is TensorRT-derived in every method."""
    found: dict[str, str] = {}
    local = dict(derived)
    for _ in range(3):  # chains such as self.trt -> self.engine -> self.context
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                scratch = {**local, **found}
                _bind(node.targets, node.value, scratch)
                for key, kind in scratch.items():
                    if key.startswith("self.") and key.count(".") == 1:
                        found[key] = kind
                    elif "." not in key:
                        local.setdefault(key, kind)  # locals that feed self attributes (runtime -> engine)
    return found


def scan(path: Path) -> _Scanner:
    tree = ast.parse(path.read_text())
    roots = _module_roots(tree)
    scanner = _Scanner()
    derived: dict[str, str] = {}
    for name, kind in roots.items():
        if "-value:" in kind:  # from tensorrt import X
            kind, value = kind.split("-value:")
            scanner.names.add((kind, value))
            scanner.qualified.add((kind, value))
        derived[name] = kind
    derived.update(_self_attributes(tree, derived))
    scanner.scope(tree, derived, set(roots) | {k for k, v in derived.items() if k.startswith("self.") and k[5:] in CONVENTION})
    return scanner


def project_usage(package: Path = PACKAGE) -> tuple[dict[tuple[str, str], set[str]], dict[tuple[str, str], set[str]]]:
    """({(kind, name): files}, {(kind, qualified chain): files}) over every module of the package."""
    names: dict[tuple[str, str], set[str]] = {}
    qualified: dict[tuple[str, str], set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        result = scan(path)
        where = str(path.relative_to(package.parent))
        for item in result.names:
            names.setdefault(item, set()).add(where)
        for item in result.qualified:
            qualified.setdefault(item, set()).add(where)
    return names, qualified


def _exists(kind: str, name: str, binary: bytes, plugin_source: str) -> bool:
    if name.startswith("__") and name.endswith("__"):
        return True  # module dunders (__version__) and Python protocol methods
    escaped = re.escape(name)
    in_plugin = re.search(rf"\b(def|class)\s+{escaped}\b|\b{escaped}\s*[:=]|\.{escaped}\b", plugin_source)
    if kind == "trtp":
        return bool(in_plugin)
    # The linker merges string tails ("Builder" may live inside "IBuilder\0"): match NUL-terminated suffixes.
    return re.search(re.escape(name.encode()) + rb"\x00", binary) is not None or bool(in_plugin)


def _removed(names, qualified) -> list[str]:
    hits = [f"trt.{chain} ({', '.join(sorted(files))})" for (kind, chain), files in qualified.items()
            if kind == "trt" and any(chain == r or chain.endswith("." + r) or chain.startswith(r + ".") for r in REMOVED_QUALIFIED)]
    hits += [f"trt.{name} ({', '.join(sorted(files))})" for (kind, name), files in names.items()
             if kind == "trt" and name in REMOVED_MEMBERS]
    return sorted(hits)


# ---------------------------------------------------------------------------------------------------------------
# The tests


def test_the_scan_sees_the_builder_the_runner_the_engine_check_and_the_python_plugin():
    names, qualified = project_usage()
    found = {name for _, name in names}
    assert {"Builder", "create_network", "STRONGLY_TYPED", "parse_from_file", "num_errors", "get_error",
            "build_serialized_network", "set_memory_pool_limit", "create_optimization_profile", "set_shape",
            "create_timing_cache", "set_timing_cache", "AMPERE_PLUS", "SAME_COMPUTE_CAPABILITY", "plugins_to_serialize",
            "load_library", "PREFER_AOT_PYTHON_PLUGINS", "parse"} <= found  # kvzap_export/trt/builder.py, where trt is
    # a parameter or from import_tensorrt()
    assert {"deserialize_cuda_engine", "execute_async_v3", "set_tensor_address", "get_tensor_name", "set_input_shape",
            "num_io_tensors"} <= found  # kvzap_export/runners/trt.py, through self.trt / self.engine / self.context
    assert {"register", "aot_impl", "KernelLaunchParams", "shape_expr", "from_shape_expr", "QuickPluginCreationRequest"
            } <= found  # QDP plugin
    assert ("trt", "NetworkDefinitionCreationFlag.STRONGLY_TYPED") in qualified
    assert ("trt", "MemoryPoolType.WORKSPACE") in qualified and ("trt", "Logger.WARNING") in qualified
    assert any("kvzap_export/trt/compatibility.py" in files for files in names.values())


def test_every_tensorrt_name_exists_in_tensorrt_11(api):
    binary, plugin_source = api
    names, _ = project_usage()
    missing = sorted(f"{kind}.{name} ({', '.join(sorted(files))})" for (kind, name), files in names.items()
                     if not _exists(kind, name, binary, plugin_source))
    assert not missing, "names not in TensorRT 11.4's Python API:\n" + "\n".join(missing)


def test_no_name_removed_by_tensorrt_10_or_11_is_used():
    names, qualified = project_usage()
    removed = _removed(names, qualified)
    assert not removed, "TensorRT 11 removed these (use typed ONNX graphs / the tensor API instead):\n" + "\n".join(removed)


def test_the_checks_catch_wrong_and_removed_names(api, tmp_path):
    """The scanner and both checks, on a module written the way a mistake would look."""
    binary, plugin_source = api
    (tmp_path / "mistakes.py").write_text(
        "def build(path):\n"
        "    from kvzap_export.trt.availability import import_tensorrt\n"
        "    trt, _ = import_tensorrt()\n"
        "    with trt.Builder(trt.Logger(trt.Logger.WARNING)) as builder:\n"
        "        config = builder.create_builder_config()\n"
        "        config.set_flag(trt.BuilderFlag.INT8)\n"
        "        config.max_workspace_size = 1 << 30\n"
        "        config.set_memory_pool_limits(getattr(trt.MemoryPoolType, 'WORKSPACES'), 1)\n"
        "        return builder.build_engine(None, config)\n"
        "def plugin(desc: 'x', scores):\n"
        "    import tensorrt.plugin as trtp\n"
        "    def inner(d: trtp.TensorDesc):\n"
        "        return d.shape_expresion, trtp.quantum_impl\n")
    names, qualified = project_usage(tmp_path)
    missing = {name for (kind, name) in names if not _exists(kind, name, binary, plugin_source)}
    assert {"set_memory_pool_limits", "WORKSPACES", "build_engine", "shape_expresion", "quantum_impl"} <= missing
    assert {"Builder", "create_builder_config", "set_flag", "WARNING"}.isdisjoint(missing)
    removed = "\n".join(_removed(names, qualified))
    assert "trt.BuilderFlag.INT8" in removed and "trt.max_workspace_size" in removed and "trt.build_engine" in removed
    assert not _exists("trt", "BuilderFlagFP17", binary, plugin_source)
    assert _exists("trt", "OnnxParser", binary, plugin_source) and _exists("trtp", "aot_impl", binary, plugin_source)
