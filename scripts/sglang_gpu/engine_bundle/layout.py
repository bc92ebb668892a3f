"""The bundle's own files: the stand-ins and start-up stubs, the stand-in's dist-info, ``install.sh`` and the manifest.

Bundle layout (``.gpu/engine/``)::

    install.sh                      installs everything below into one site directory (default /tmp/sglang-site)
    manifest.json                   what is here, with sizes, hashes and every requirement's decision
    sglang-<v>-trimmed.tar.gz       SGLang's wheel, trimmed (trim.py)
    wheels/*.whl                    the carried requirements (closure.py), installed with pip --no-index --no-deps
    standin/                        copied into the site directory as is:
        sgl_kernel/                 kvzap-export's CUDA stand-in for sgl-kernel (scripts/sglang_gpu/sgl_kernel)
        sglang_kernel-<v>.dist-info/  so that importlib.metadata.version("sglang-kernel") answers (SGLang checks it)
        sitecustomize.py, IPython/  start-up stubs (scripts/sglang_gpu/startup)
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

# SGLang 0.5.23 asserts sglang-kernel >= 0.4.9 on CUDA (srt/entrypoints/engine.py:1961-1966, _set_envs_and_config).
# The local version label marks the stand-in; PEP 440 orders 0.4.9+kvzap.standin after 0.4.9, so the check passes.
STANDIN_DIST_VERSION = "0.4.9+kvzap.standin"
STANDIN_METADATA = f"""\
Metadata-Version: 2.1
Name: sglang-kernel
Version: {STANDIN_DIST_VERSION}
Summary: kvzap-export's CUDA stand-in for sgl-kernel (plain torch; not sgl-kernel). See sgl_kernel/__init__.py.
Home-page: https://github.com/sgl-project/sglang (the real sgl-kernel; this is not it)

This distribution is kvzap-export's stand-in for sgl-kernel on GPU machines without network
(scripts/sglang_gpu/sgl_kernel in the kvzap-export repository). It implements in plain torch only the
sgl-kernel ops that SGLang 0.5.23 calls for dense Llama and Qwen3 with the Triton attention backend and the
pytorch sampling backend; every other op raises an error naming itself. Its version satisfies SGLang's
minimum-version check; the local label '+kvzap.standin' says what it is.
"""

INSTALL_SH = """\
#!/usr/bin/env bash
# Installs kvzap-export's SGLang {sglang_version} bundle into SITE (default /tmp/sglang-site), with no network:
#   bash install.sh [SITE]      (PYTHON=... picks the interpreter; default python3)
# Removes SITE first (a machine keeps /tmp between runs), installs the carried wheels with pip --no-index --no-deps,
# unpacks the trimmed SGLang tree and copies the stand-ins (sgl_kernel, sglang-kernel's dist-info, sitecustomize.py,
# IPython.display). Progress goes to stderr; the last line on stdout is the PYTHONPATH to use, e.g.
#   eval "$(bash .gpu/engine/install.sh)"
# On CUDA, SGLang 0.5.23 also builds kernels of its own at run time (JIT: nvcc + tvm-ffi, which is carried): SiLU-and-mul
# for 16-byte-aligned widths, RoPE and decode positions, with no fallback; Qwen3's q/k norm and the KV-cache store try
# and fall back to torch. Whether they build on these machines has not been seen yet. SGLANG_FORCE_FUSED_OP_BACKEND=torch
# sends the first three (and RMSNorm, so the stand-in's norm ops go unused) to SGLang's torch code; see
# scripts/sglang_gpu/emulate_gpu_imports.py --jit-paths in the kvzap-export repository.
set -euo pipefail
HERE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
SITE="${{1:-/tmp/sglang-site}}"
PY="${{PYTHON:-python3}}"
step() {{ echo "[install.sh] $*" >&2; }}

step "clearing $SITE"
rm -rf "$SITE" && mkdir -p "$SITE"
step "{wheel_count} wheels (pip --no-index --no-deps --target)"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \\
  --target "$SITE" "$HERE"/wheels/*.whl >&2
step "SGLang {sglang_version}, trimmed"
tar -xzf "$HERE/{archive}" -C "$SITE"
step "stand-ins and start-up stubs"
cp -R "$HERE"/standin/. "$SITE"/
PYTHONPATH="$SITE${{PYTHONPATH:+:$PYTHONPATH}}" "$PY" - >&2 <<'PY'
import importlib.metadata as m, importlib.util as u
print(f"[install.sh] sglang {{m.version('sglang')}}, sglang-kernel {{m.version('sglang-kernel')}} "
      f"(stand-in at {{u.find_spec('sgl_kernel').origin}})")
PY
echo "export PYTHONPATH=$SITE${{PYTHONPATH:+:$PYTHONPATH}}"
"""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _copy_tree(source: Path, dest: Path) -> None:
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"), dirs_exist_ok=True)


def write_standin(scripts: Path, dest: Path) -> None:
    """dest/: sgl_kernel/, the stand-in's dist-info, sitecustomize.py and IPython/ (from scripts/sglang_gpu)."""
    dest.mkdir(parents=True, exist_ok=True)
    _copy_tree(scripts / "sgl_kernel", dest / "sgl_kernel")
    for item in sorted((scripts / "startup").iterdir()):
        if item.name == "__pycache__":
            continue
        if item.is_dir():
            _copy_tree(item, dest / item.name)
        else:
            shutil.copy2(item, dest / item.name)
    dist_info = dest / f"sglang_kernel-{STANDIN_DIST_VERSION}.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(STANDIN_METADATA)
    (dist_info / "top_level.txt").write_text("sgl_kernel\n")
    (dist_info / "INSTALLER").write_text("kvzap-export build_engine.py\n")


def write_install_sh(dest: Path, sglang_version: str, archive: str, wheel_count: int) -> None:
    path = dest / "install.sh"
    path.write_text(INSTALL_SH.format(sglang_version=sglang_version, archive=archive, wheel_count=wheel_count))
    path.chmod(0o755)


def file_list(root: Path) -> list[dict]:
    """Every file under root: {path (relative, '/'), bytes}, sorted by path."""
    return [{"path": p.relative_to(root).as_posix(), "bytes": p.stat().st_size}
            for p in sorted(root.rglob("*")) if p.is_file()]
