"""SGLang's own Triton attention kernels, loaded at run time (never copied into this repository).

``decode_attention_fwd`` of SGLang 0.5.23 (``sglang/kernels/ops/attention/decode_attention.py``: page size 1,
``kv_indptr``/``kv_indices``, split along the sequence) reads our per-head layout when each (request, KV head) is
passed as one sequence with one KV head (``flattened_attention``). Where its file comes from:

1. an explicit ``path`` (``--sglang-kernels PATH``), else ``$KVZAP_SGLANG_KERNELS``: the sglang wheel (a zip), a
   zip or a directory holding ``sglang/kernels/ops/attention/{decode_attention,score_mod}.py`` (a site-packages
   directory, or the ``sglang`` package directory itself). The files are executed from there; what they import
   from SGLang's runtime (``sglang.srt``) is stood in by the small functions of this module (``STOOD_IN``);
2. otherwise the installed ``sglang`` package (the engine environment), imported normally: nothing stood in.

While a file from a path executes, its imports are answered by entries put in ``sys.modules`` under SGLang's names;
they are removed (and any entry they replaced put back) before ``load`` returns, so a process that imports the real
SGLang afterwards (or before) sees the real modules. The loaded modules are not registered in ``sys.modules``.
A file inside a zip is given to ``linecache`` so that ``inspect.getsource`` (Triton's ``@jit``) finds it.

Stood in (names SGLang's kernel files import, answered by us when loading from a path; ``STOOD_IN``):

- ``sglang.srt.environ.envs``: the five variables the decode and extend files read, from ``os.environ`` with
  SGLang 0.5.23's defaults (any other name raises AttributeError, naming it);
- ``sglang.srt.utils``: ``get_device_core_count`` (the CUDA device's SM count, 0 without CUDA), ``is_hip``
  (ROCm torch), ``is_cuda`` (a CUDA torch with a GPU), ``is_gfx95_supported`` / ``is_gfx1250_supported`` (the ROCm
  arch name; False on CUDA);
- ``sglang.srt.runtime_context.get_exec`` (imported lazily by the decode file, only on ROCm with MLA, head dim
  576): never imported; the decode module's cache ``_KEEP_SCHEDULER_SPLITS`` is preset to False, which is what
  ``get_exec`` answers without deterministic inference, a split tile size or the static-splits variable.

``score_mod.py`` (and ``decode_attention.py`` for the extend file) are SGLang's own files, loaded from the same place.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import linecache
import os
import re
import sys
import threading
import types
import zipfile
from pathlib import Path

from kvzap_export.errors import ConfigError, MissingDependencyError

ENV_VAR = "KVZAP_SGLANG_KERNELS"
ATTENTION = "sglang/kernels/ops/attention"
PACKAGE = "sglang.kernels.ops.attention"
DECODE_FILES = ("score_mod", "decode_attention")
EXTEND_FILES = DECODE_FILES + ("extend_attention",)

STOOD_IN = {
    "sglang.srt.environ.envs": "SGLANG_TRITON_DECODE_ATTN_STATIC_KV_SPLITS (False), SGLANG_MLA_DECODE_TUNE (False), "
                               "SGLANG_FORCE_LEAN_GRID_CU_MULT (1.0), SGLANG_TRITON_FP8_PREFILL_ATTN (True), "
                               "SGLANG_TRITON_COMPACT_EXTEND_ATTENTION (True): os.environ, SGLang 0.5.23's defaults",
    "sglang.srt.utils.get_device_core_count": "torch.cuda.get_device_properties(i).multi_processor_count; 0 without CUDA",
    "sglang.srt.utils.is_hip": "torch.version.hip is not None",
    "sglang.srt.utils.is_cuda": "torch.version.cuda is not None and torch.cuda.is_available()",
    "sglang.srt.utils.is_gfx95_supported": "ROCm and the device's gcnArchName starts with gfx95 (False on CUDA)",
    "sglang.srt.utils.is_gfx1250_supported": "ROCm and the device's gcnArchName starts with gfx1250 (False on CUDA)",
    "sglang.srt.runtime_context.get_exec": "not imported: decode_attention._KEEP_SCHEDULER_SPLITS preset to False "
                                           "(read only on ROCm with MLA, head dim 576)",
}

_SYS_MODULES = threading.Lock()
_MISSING = (f"SGLang's Triton decode kernel was not found: install sglang==0.5.23, or pass --sglang-kernels PATH (or set "
            f"{ENV_VAR}) to the sglang 0.5.23 wheel or a directory/zip holding {ATTENTION}/decode_attention.py and "
            "score_mod.py")


@dataclasses.dataclass(frozen=True)
class KernelSource:
    """Where the kernel files came from: ``origin`` installed | wheel | zip | directory; ``location`` the package
    directory, zip or directory; ``version`` SGLang's version where it says (None otherwise); ``stood_in``: the names
    of ``STOOD_IN`` answered by us (empty for the installed package)."""

    origin: str
    location: str
    version: str | None
    stood_in: tuple[str, ...]

    def as_dict(self) -> dict:
        return {"origin": self.origin, "location": self.location, "version": self.version,
                "stood_in": {name: STOOD_IN[name] for name in self.stood_in}}


@dataclasses.dataclass(frozen=True)
class SGLangKernels:
    """``decode``: SGLang's decode_attention module (``decode.decode_attention_fwd``); ``extend``: its
    extend_attention module where asked for (else None); ``source``: where they came from."""

    decode: types.ModuleType
    extend: types.ModuleType | None
    source: KernelSource


# ---- the stand-ins ------------------------------------------------------------------------------------------
class _Env:
    """One variable of ``envs``: ``.get()`` reads os.environ, parsed as SGLang's EnvBool/EnvFloat do."""

    def __init__(self, name: str, default):
        self.name, self.default = name, default

    def get(self):
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        if isinstance(self.default, bool):
            value = raw.strip().lower()
            if value in ("true", "1", "yes", "y"):
                return True
            if value in ("false", "0", "no", "n"):
                return False
            raise ConfigError(f"{self.name}={raw!r} is not a boolean (true/false, 1/0, yes/no)")
        return type(self.default)(raw)


class _Envs:
    _DEFAULTS = {"SGLANG_TRITON_DECODE_ATTN_STATIC_KV_SPLITS": False, "SGLANG_MLA_DECODE_TUNE": False,
                 "SGLANG_FORCE_LEAN_GRID_CU_MULT": 1.0, "SGLANG_TRITON_FP8_PREFILL_ATTN": True,
                 "SGLANG_TRITON_COMPACT_EXTEND_ATTENTION": True}

    def __getattr__(self, name: str) -> _Env:
        if name not in self._DEFAULTS:
            raise AttributeError(f"SGLang's kernel file reads envs.{name}, which kvzap-export does not stand in "
                                 "(another SGLang version?): install sglang==0.5.23 instead")
        return _Env(name, self._DEFAULTS[name])


def _torch():
    import torch

    return torch


def is_hip() -> bool:
    return getattr(_torch().version, "hip", None) is not None


def is_cuda() -> bool:
    torch = _torch()
    return torch.version.cuda is not None and torch.cuda.is_available()


def get_device_core_count(device_id: int = 0) -> int:
    torch = _torch()
    return torch.cuda.get_device_properties(device_id).multi_processor_count if torch.cuda.is_available() else 0


def _rocm_arch(prefix: str) -> bool:
    torch = _torch()
    if not is_hip() or not torch.cuda.is_available():
        return False
    return getattr(torch.cuda.get_device_properties(0), "gcnArchName", "").startswith(prefix)


def is_gfx95_supported() -> bool:
    return _rocm_arch("gfx95")


def is_gfx1250_supported() -> bool:
    return _rocm_arch("gfx1250")


def _stand_in_modules() -> dict[str, types.ModuleType]:
    environ = types.ModuleType("sglang.srt.environ")
    environ.envs = _Envs()
    utils = types.ModuleType("sglang.srt.utils")
    for fn in (get_device_core_count, is_hip, is_cuda, is_gfx95_supported, is_gfx1250_supported):
        setattr(utils, fn.__name__, fn)
    return {"sglang.srt.environ": environ, "sglang.srt.utils": utils}


# ---- finding the files ------------------------------------------------------------------------------------------
class _Files:
    """Reads ``sglang/kernels/ops/attention/<name>.py`` from a directory or a zip."""

    def __init__(self, path: Path):
        self.path = path
        self.zip = zipfile.ZipFile(path) if path.is_file() else None
        if self.zip is not None:
            names = self.zip.namelist()
            found = [n for n in names if n.endswith(f"{ATTENTION}/decode_attention.py")]
            if not found:
                raise ConfigError(f"--sglang-kernels {path}: no {ATTENTION}/decode_attention.py inside this zip; pass "
                                  "the sglang 0.5.23 wheel or a zip of its sglang/ package")
            self.prefix = found[0][: -len("decode_attention.py")]
            self.names = set(names)
        else:
            candidates = [path / ATTENTION, path / "kernels/ops/attention"]  # site-packages, or the sglang package
            self.root = next((c for c in candidates if (c / "decode_attention.py").is_file()), None)
            if self.root is None:
                raise ConfigError(f"--sglang-kernels {path}: no {ATTENTION}/decode_attention.py under this directory; "
                                  "pass a site-packages directory, the sglang package directory or the sglang wheel")

    @property
    def origin(self) -> str:
        if self.zip is None:
            return "directory"
        return "wheel" if self.path.suffix == ".whl" else "zip"

    def read(self, name: str) -> tuple[str, str]:
        """(file name to report, source text) of ``<name>.py``."""
        if self.zip is not None:
            member = f"{self.prefix}{name}.py"
            if member not in self.names:
                raise ConfigError(f"--sglang-kernels {self.path}: {member} is missing from this zip")
            return f"{self.path}/{member}", self.zip.read(member).decode()
        file = self.root / f"{name}.py"
        if not file.is_file():
            raise ConfigError(f"--sglang-kernels {self.path}: {file} is missing")
        return str(file), file.read_text()

    def version(self) -> str | None:
        pattern = re.compile(r"^sglang-([0-9][^/-]*)\.dist-info/")
        if self.zip is not None:
            for name in self.names:
                match = pattern.match(name)
                if match:
                    return match.group(1)
            return None
        package = self.root.parents[2]  # .../sglang
        text = (package / "_version.py").read_text() if (package / "_version.py").is_file() else ""
        match = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", text)
        if match:
            return match.group(1)
        for info in package.parent.glob("sglang-*.dist-info"):
            return info.name[len("sglang-"): -len(".dist-info")]
        return None


def _execute(name: str, filename: str, text: str, zipped: bool) -> types.ModuleType:
    """Runs one file as module ``name`` (registered in sys.modules for the duration of the caller's loading)."""
    module = types.ModuleType(name)
    module.__file__ = filename
    module.__package__ = name.rpartition(".")[0]
    if zipped:  # inspect.getsource (Triton's jit) reads the lines from here; mtime None: never invalidated
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    sys.modules[name] = module
    exec(compile(text, filename, "exec"), module.__dict__)  # noqa: S102 - SGLang's own kernel file, by the user's path
    return module


def _load_from_path(path: Path, extend: bool) -> SGLangKernels:
    files = _Files(path)
    names = EXTEND_FILES if extend else DECODE_FILES
    stand_ins = _stand_in_modules()
    touched = list(stand_ins) + [f"{PACKAGE}.{name}" for name in names]
    loaded = {}
    with _SYS_MODULES:  # two loads at once must not interleave their sys.modules edits
        saved = {key: sys.modules[key] for key in touched if key in sys.modules}
        try:
            sys.modules.update(stand_ins)
            for name in names:
                filename, text = files.read(name)
                loaded[name] = _execute(f"{PACKAGE}.{name}", filename, text, files.zip is not None)
        finally:
            for key in touched:
                sys.modules.pop(key, None)
            sys.modules.update(saved)
            if files.zip is not None:
                files.zip.close()
    decode = loaded["decode_attention"]
    if hasattr(decode, "_KEEP_SCHEDULER_SPLITS"):
        decode._KEEP_SCHEDULER_SPLITS = False  # stands in for runtime_context.get_exec (STOOD_IN)
    source = KernelSource(files.origin, str(path), files.version(), tuple(STOOD_IN))
    return SGLangKernels(decode, loaded.get("extend_attention"), source)


def _load_installed(extend: bool) -> SGLangKernels:
    decode = importlib.import_module(f"{PACKAGE}.decode_attention")
    ext = importlib.import_module(f"{PACKAGE}.extend_attention") if extend else None
    try:
        from importlib.metadata import version

        found = version("sglang")
    except Exception:  # noqa: BLE001 - the version is informational
        found = None
    location = str(Path(decode.__file__).resolve().parents[3])
    return SGLangKernels(decode, ext, KernelSource("installed", location, found, ()))


@functools.lru_cache(maxsize=None)
def _load(path: str | None, extend: bool) -> SGLangKernels:
    if importlib.util.find_spec("triton") is None:
        raise MissingDependencyError("SGLang's Triton decode kernel needs triton: pip install 'kvzap-export[gpu]'")
    if path is not None:
        resolved = Path(path).expanduser()
        if not resolved.exists():
            raise ConfigError(f"--sglang-kernels {path}: no such file or directory; pass the sglang 0.5.23 wheel or a "
                              f"directory holding {ATTENTION}/decode_attention.py")
        return _load_from_path(resolved.resolve(), extend)
    if importlib.util.find_spec("sglang") is None:
        raise MissingDependencyError(_MISSING)
    return _load_installed(extend)


def load(path: str | os.PathLike | None = None, *, extend: bool = False) -> SGLangKernels:
    """SGLang's kernel modules: from ``path`` (or ``$KVZAP_SGLANG_KERNELS``) where given, else the installed sglang.
    Cached per (path, extend). ``MissingDependencyError`` (neither given nor installed), ``ConfigError`` (a path
    without the files): one line naming what to pass."""
    chosen = path if path is not None else os.environ.get(ENV_VAR) or None
    return _load(None if chosen is None else str(chosen), extend)
