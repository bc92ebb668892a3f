"""No two parts of ``kvzap_export`` import each other, directly or through others (DESIGN: no import cycles), nor
two of its modules, and no module imports another's private (``_``) names.

A part is a subpackage (``kvzap_export/trt/``) or a top-level module (``kvzap_export/pipeline.py``). Every
import of the package's source counts, wherever it stands: module level, inside a function (the lazy imports of
optional dependencies), under ``if TYPE_CHECKING``, and ``importlib.import_module("kvzap_export....")`` with a
literal name. Between modules, ``from pkg import name`` is an edge to ``pkg.name`` when that is a module and to
``pkg`` (its ``__init__``) otherwise. Cycles are found by the standard library's ``graphlib``.
"""

import ast
import graphlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvzap_export"


def _part(module: str) -> str | None:
    """``kvzap_export.trt.builder`` -> ``trt``; None outside the package or for the package itself."""
    parts = module.split(".")
    return parts[1] if parts[0] == "kvzap_export" and len(parts) > 1 else None


def _module_name(path: Path, package_root: Path) -> str:
    """``kvzap_export/kernels/ragged_attention.py`` -> ``kvzap_export.kernels.ragged_attention`` (a package: its name)."""
    parts = path.relative_to(package_root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path, package_root: Path, modules: set[str] | None = None) -> set[str]:
    """Absolute names of the modules one source file imports (relative imports resolved). Given the package's
    ``modules``, ``from pkg import name`` counts ``pkg.name`` when that is one of them and ``pkg`` only otherwise."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = ".".join(path.relative_to(package_root.parent).with_suffix("").parts)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            named = {f"{module}.{alias.name}" for alias in node.names}  # from kvzap_export import trt
            if modules is None:
                found.add(module)
                found.update(named)
            else:
                found.update(named & modules)
                if named - modules:
                    found.add(module)
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value)
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, dict[str, list[str]]]:
    """{part: {imported part: [files that import it]}} over every module of ``package``."""
    graph: dict[str, dict[str, set[str]]] = {}
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        source = relative.parts[0] if len(relative.parts) > 1 else relative.stem
        edges = graph.setdefault(source, {})
        for module in _imported_modules(path, package):
            target = _part(module)
            if target is not None and target != source:
                edges.setdefault(target, set()).add(relative.as_posix())
    # Names that are no part (``from kvzap_export import __version__``) are left out.
    return {part: {target: sorted(files) for target, files in edges.items() if target in graph}
            for part, edges in graph.items()}


def find_cycle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """One cycle of parts (first == last), or None."""
    try:
        graphlib.TopologicalSorter({part: set(edges) for part, edges in graph.items()}).prepare()
    except graphlib.CycleError as error:
        return list(error.args[1])
    return None


def module_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: modules of the package it imports}, every import counted (function level, TYPE_CHECKING)."""
    paths = {_module_name(path, package): path for path in sorted(package.rglob("*.py"))}
    names = set(paths)
    return {name: {m for m in _imported_modules(path, package, names) if m in names and m != name}
            for name, path in paths.items()}


def private_imports(package: Path = PACKAGE) -> list[str]:
    """``file: from module import _name`` for every private name one module of the package takes from another."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(package.name)):
                found += [f"{path.relative_to(package).as_posix()}: from {'.' * node.level}{node.module or ''} "
                          f"import {alias.name}" for alias in node.names
                          if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def _explain(graph, cycle: list[str]) -> str:
    # graphlib lists a cycle against the edge direction: cycle[i + 1] imports cycle[i].
    return "\n".join(f"{b} -> {a}" + (f" ({', '.join(sorted(set(graph[b][a])))})" if isinstance(graph[b], dict) else "")
                     for a, b in zip(cycle, cycle[1:]))


def test_no_two_parts_of_the_package_import_each_other():
    graph = import_graph()
    cycle = find_cycle(graph)
    if cycle is not None:
        raise AssertionError("import cycle between parts of kvzap_export:\n" + _explain(graph, cycle))


def test_no_two_modules_of_the_package_import_each_other():
    graph = module_graph()
    cycle = find_cycle(graph)
    if cycle is not None:
        raise AssertionError("import cycle between modules of kvzap_export:\n" + _explain(graph, cycle))


def test_no_module_imports_another_modules_private_names():
    assert private_imports() == []


def test_the_scan_sees_function_level_relative_and_dynamic_imports(tmp_path):
    """The checks on a package written the way a cycle would creep in."""
    root = tmp_path / "kvzap_export"
    for folder in ("a", "b", "c"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "a" / "one.py").write_text("def f():\n    from kvzap_export.b.two import g\n")  # function level
    (root / "b" / "two.py").write_text("from ..c import three\n")  # relative, names a submodule
    (root / "c" / "three.py").write_text("import importlib\nm = importlib.import_module('kvzap_export.a.one')\n")
    (root / "top.py").write_text("import kvzap_export.a\n")
    graph = import_graph(root)
    assert graph["a"] == {"b": ["a/one.py"]} and graph["b"] == {"c": ["b/two.py"]} and graph["c"] == {"a": ["c/three.py"]}
    assert graph["top"] == {"a": ["top.py"]}
    assert sorted(find_cycle(graph)[:-1]) == ["a", "b", "c"]
    (root / "c" / "three.py").write_text("")
    assert find_cycle(import_graph(root)) is None


def test_the_module_scan_sees_cycles_inside_a_part_and_private_names(tmp_path):
    """Two modules of one subpackage that import each other (one of them inside a function), a package importing
    its submodule (no edge back from ``from pkg import sub``), and a private name taken across modules."""
    root = tmp_path / "kvzap_export"
    (root / "k").mkdir(parents=True)
    (root / "k" / "__init__.py").write_text("from kvzap_export.k import fast\n")
    (root / "k" / "fast.py").write_text("from kvzap_export.k.slow import _check\n")
    (root / "k" / "slow.py").write_text("def f():\n    from kvzap_export.k import fast\n")
    (root / "k" / "other.py").write_text("from kvzap_export.k import fast\n")
    graph = module_graph(root)
    assert graph["kvzap_export.k"] == {"kvzap_export.k.fast"} and graph["kvzap_export.k.other"] == {"kvzap_export.k.fast"}
    assert sorted(find_cycle(graph)[:-1]) == ["kvzap_export.k.fast", "kvzap_export.k.slow"]
    assert find_cycle(import_graph(root)) is None  # one part: the part-level test cannot see it
    assert private_imports(root) == ["k/fast.py: from kvzap_export.k.slow import _check"]
    (root / "k" / "slow.py").write_text("def _check():\n    pass\n")
    assert find_cycle(module_graph(root)) is None
