"""Every SGLang name our glue uses exists in the real sglang==0.5.23 source, with the parameters we rely on.

The wheel is downloaded from the package registry (``pip download --no-deps``; pinned to one platform
tag so every CI machine reads the same file), cached under pytest's cache directory, never installed:
its Python sources are read straight from the zip and parsed with ``ast``. The list of names is
``kvzap_export.integrations.sglang.api.SGLANG_API`` (one place). Skips only when the registry is unreachable.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvzap_export.integrations.sglang import api as glue

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
        targets = list(node.targets) if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        flat = []  # ``self.a, self.b = ...``: each element of a tuple target
        while targets:
            t = targets.pop()
            targets.extend(t.elts) if isinstance(t, (ast.Tuple, ast.List)) else flat.append(t)
        for t in flat:
            if isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name) and t.value.id == "self":
                return True
    return False


def param_names(fn: ast.FunctionDef) -> list[str]:
    """Positional parameters, then keyword-only ones (hooks that receive keywords rely on those too)."""
    return [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]


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
                is_property = any(_decorator_name(d) in ("property", "cached_property") for d in node.decorator_list)
                if api.kind == "property":
                    return None if is_property else f"{api.target} is a method, not a property (call it)"
                if is_property:
                    return f"{api.target} is a property, not a method (read it, do not call it)"
                got = param_names(node)
                if got[: len(api.params)] != list(api.params):
                    return f"{api.target} parameters {got}, expected to start with {list(api.params)}"
                return None
    return f"{api.target}: no such {api.kind}"


def _decorator_name(node: ast.AST) -> str:
    """``@property`` -> "property", ``@functools.cached_property`` -> "cached_property", ``@x(...)`` -> "x"."""
    node = node.func if isinstance(node, ast.Call) else node
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def test_every_sglang_name_exists_with_our_signature(wheel):
    source = Source(wheel)
    problems = [p for p in (problem(source, a) for a in glue.SGLANG_API) if p]
    assert not problems, "SGLang API drift:\n" + "\n".join(problems)


PACKAGE = Path(glue.__file__).parent
OUR_BACKENDS = {"kvzap_native", "kvzap_flex", "kvzap_ragged"}  # added to --attention-backend's choices at load


def glue_sources() -> list[tuple[str, str]]:
    return [(f"kvzap_export/integrations/sglang/{p.name}", p.read_text()) for p in sorted(PACKAGE.glob("*.py"))]


def test_glue_uses_only_listed_names():
    """Hook targets are looked up in SGLANG_API; a name missing from the list would fail at install time."""
    text = "\n".join(t for _, t in glue_sources())
    used = set(re.findall(r'\bapi\("([^"]+)"\)', text)) | set(glue.SCORED_ATTENTION)
    listed = {a.qualname for a in glue.SGLANG_API}
    assert used and used <= listed, used - listed
    assert len(listed) == len(glue.SGLANG_API), "duplicate qualnames in SGLANG_API"


def test_req_to_token_pool_calls_what_the_ragged_rows_implement(wheel):
    """SGLang calls these on an aux cache attached to its ReqToTokenPool; ragged_rows.StoreRows implements each."""
    from kvzap_export.integrations.sglang.api import AUX_CACHE_PROTOCOL
    from kvzap_export.integrations.sglang.ragged_rows import StoreRows

    source = wheel.read("sglang/srt/mem_cache/memory_pool.py").decode()
    start = source.index("class ReqToTokenPool")
    body = source[start: source.index("\nclass ", start + 1)]
    assert all(call in body for call in AUX_CACHE_PROTOCOL), [c for c in AUX_CACHE_PROTOCOL if c not in body]
    for name in ("alloc_to_lengths", "free", "clear", "reset_allocator"):
        assert callable(getattr(StoreRows, name))
    assert "dense_capacity" in StoreRows.__init__.__code__.co_names


def test_checker_catches_drift(wheel):
    """The checker itself: renamed members, wrong parameters and missing modules are reported."""
    source = Source(wheel)
    bad = [
        glue.ApiName("sglang.srt.managers.scheduler", "Scheduler.process_batch_results", "method", ("self",)),
        glue.ApiName("sglang.srt.models.llama", "LlamaAttention.forward", "method", ("self", "hidden_states")),
        glue.ApiName("sglang.srt.models.no_such_model", "X", "class"),
        glue.ApiName("sglang.srt.model_executor.forward_batch_info", "ForwardBatch.no_such_field", "field"),
        glue.ApiName("sglang.srt.mem_cache.memory_pool", "MHATokenToKVPool.is_quantized_kv_cache", "method", ("self",)),
        glue.ApiName("sglang.srt.managers.schedule_batch", "Req.finished", "property"),
    ]
    assert all(problem(source, a) for a in bad), [a for a in bad if not problem(source, a)]


# ---- server flags --------------------------------------------------------------------------------------
# The glue's messages and docs/integrations.md tell users which `sglang serve` flags to pass. 0.5.23 derives
# most flags from annotated config fields (``name: A[type, Arg(cli_name=, aliases=, no_cli=, choices=)]`` in
# ``sglang/srt/arg_groups/fields/``, flag = "--" + name with dashes) and adds a few with ``add_argument``
# (``server_args.py``; deprecated spellings use a ``Deprecated*`` action). Both are read here.

FLAG_USE = re.compile(r"(?<![\w-])(--[a-z][a-z0-9]*(?:-[a-z0-9]+)*)(?:[ =]([A-Za-z0-9_.-]+))?")
DOCS = Path(__file__).resolve().parents[3] / "docs" / "integrations.md"


@dataclass(frozen=True)
class ServerFlag:
    deprecated: bool
    choices: frozenset | None  # literal choices, when the source spells them out


def _literal_strings(node: ast.AST) -> frozenset | None:
    values = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return frozenset(values) or None


def _keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_deprecated_action(node) -> bool:
    return isinstance(node, ast.Name) and node.id.startswith("Deprecated")


def _field_flags(item: ast.AnnAssign) -> dict[str, ServerFlag]:
    ann = item.annotation
    if not (isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id in ("A", "Annotated")
            and isinstance(ann.slice, ast.Tuple) and len(ann.slice.elts) >= 2):
        return {}
    kind, meta = ann.slice.elts[0], ann.slice.elts[1]
    names, deprecated = ["--" + item.target.id.replace("_", "-")], False
    literal = next((n for n in ast.walk(kind) if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name)
                    and n.value.id == "Literal"), None)
    choices = _literal_strings(literal) if literal is not None else None
    if isinstance(meta, ast.Call) and isinstance(meta.func, ast.Name) and meta.func.id == "Arg":
        no_cli = _keyword(meta, "no_cli")
        if isinstance(no_cli, ast.Constant) and no_cli.value is True:
            return {}
        cli_name, aliases, listed = _keyword(meta, "cli_name"), _keyword(meta, "aliases"), _keyword(meta, "choices")
        if isinstance(cli_name, ast.Constant):
            names[0] = cli_name.value
        if isinstance(aliases, ast.List):
            names += [e.value for e in aliases.elts if isinstance(e, ast.Constant)]
        if isinstance(listed, ast.List):
            choices = _literal_strings(listed)
        deprecated = _is_deprecated_action(_keyword(meta, "action"))
    elif not (isinstance(meta, ast.Constant) and isinstance(meta.value, str)):
        return {}  # fields without Arg or a help string get no flag
    return {name: ServerFlag(deprecated, choices) for name in names}


def server_flags(source: Source) -> dict[str, ServerFlag]:
    """Every command-line flag of ``sglang serve`` in the wheel."""
    flags: dict[str, ServerFlag] = {}
    for path in sorted(source.names):
        if not (path.startswith("sglang/srt/arg_groups/fields/") and path.endswith(".py")) and path != "sglang/srt/server_args.py":
            continue
        for node in ast.walk(ast.parse(source.zf.read(path).decode("utf-8"), filename=path)):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        flags.update(_field_flags(item))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
                listed = _keyword(node, "choices")
                flag = ServerFlag(_is_deprecated_action(_keyword(node, "action")),
                                  _literal_strings(listed) if isinstance(listed, ast.List) else None)
                flags.update({a.value: flag for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")})
    return flags


def flags_we_tell_users() -> list[tuple[str, str | None, str]]:
    """(flag, value or None, where) for every flag named in the SGLang glue and the SGLang part of the docs.

    A line that says "deprecated" may name a deprecated flag (to point from the old spelling to the new one);
    lines running other commands (pip, kvzap-export and its ``validate --engine``) are not SGLang's.
    """
    docs = DOCS.read_text()
    section = docs[docs.index("## SGLang"): docs.index("\n## ", docs.index("## SGLang") + 1)]
    found = []
    for where, text in (*glue_sources(), ("docs/integrations.md", section)):
        for number, line in enumerate(text.splitlines(), 1):
            if re.search(r"\bpip (download|install)\b|\bkvzap-export\b|\bvalidate\b.*--engine", line):
                continue
            for flag, value in FLAG_USE.findall(line):
                value = value if value and not value.startswith("--") else None
                found.append((flag, value, f"{where}:{number}" + (" (deprecated allowed)" if "deprecated" in line.lower() else "")))
    return found


def flag_problems(flags: dict[str, ServerFlag], uses) -> list[str]:
    out = []
    for flag, value, where in uses:
        known = flags.get(flag)
        if known is None:
            out.append(f"{where}: {flag} is not a flag of sglang {glue.SGLANG_VERSION}")
        elif known.deprecated and "deprecated allowed" not in where:
            out.append(f"{where}: {flag} is deprecated in sglang {glue.SGLANG_VERSION}")
        elif flag == "--attention-backend" and value in OUR_BACKENDS:
            continue
        elif value is not None and known.choices and value not in known.choices:
            out.append(f"{where}: {flag} {value}: not one of {sorted(known.choices)}")
    return out


def test_every_server_flag_we_name_exists(wheel):
    uses = flags_we_tell_users()
    assert {"--disable-radix-cache", "--enable-pdmux", "--page-size", "--cuda-graph-backend-decode",
            "--attention-backend"} <= {flag for flag, _, _ in uses}
    problems = flag_problems(server_flags(Source(wheel)), uses)
    assert not problems, "flags the glue or its docs name that sglang 0.5.23 does not take:\n" + "\n".join(problems)


def test_flag_checker_catches_drift(wheel):
    flags = server_flags(Source(wheel))
    assert flags["--disable-cuda-graph"].deprecated and not flags["--disable-radix-cache"].deprecated
    assert flags["--cuda-graph-backend-decode"].choices == {"full", "breakable", "disabled"}
    assert "auto" in flags["--kv-cache-dtype"].choices and "--decode-context-parallel-size" in flags
    bad = [("--disable-cuda-graph", None, "x"), ("--no-such-flag", None, "x"), ("--cuda-graph-backend-decode", "off", "x"),
           ("--kv-cache-dtype", "fp9", "x")]
    assert len(flag_problems(flags, bad)) == len(bad)
    assert flag_problems(flags, [("--kv-cache-dtype", "auto", "x"), ("--page-size", "1", "x")]) == []
