"""The GPU bundle as built (``.gpu/engine``, by scripts/sglang_gpu/build_engine.py): every requirement met, within
50 MB, its files as the manifest lists them; the builder itself with the download cache only (``--offline``): a
build, a refusal over the size limit that leaves the earlier bundle as it was, a missing wheel named in one line;
and ``install.sh`` into a site directory. Tests that need the built bundle, the warm cache or a Python 3.12 skip,
saying so, where there is none."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.sglang_gpu.engine_bundle import closure

REPO = Path(__file__).resolve().parents[2]
BUILDER = REPO / "scripts" / "sglang_gpu" / "build_engine.py"
ENGINE, CACHE = REPO / ".gpu" / "engine", REPO / ".gpu" / "cache"
LIMIT = 50_000_000


@pytest.fixture(scope="module")
def manifest() -> dict:
    path = ENGINE / "manifest.json"
    if not path.is_file():
        pytest.skip("no GPU bundle here: build it with `python scripts/sglang_gpu/build_engine.py` (needs the index)")
    return json.loads(path.read_text())


def warm_cache() -> Path:
    if not any(CACHE.glob("sglang-0.5.23-*.whl")):
        pytest.skip("no warm download cache (.gpu/cache): run scripts/sglang_gpu/build_engine.py once where pip works")
    return CACHE


def python312() -> str | None:
    """A Python 3.12 interpreter's own path (not a shim that needs PATH), or None."""
    candidates = [shutil.which("python3.12"), *map(str, Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))]
    for candidate in filter(None, candidates):
        done = subprocess.run([candidate, "-c", "import sys; print(sys.executable); print(sys.version_info[:2])"],
                              capture_output=True, text=True, timeout=60)
        lines = done.stdout.splitlines()
        if done.returncode == 0 and len(lines) == 2 and lines[1] == "(3, 12)":
            return lines[0]
    return None


def run_builder(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BUILDER), *args], capture_output=True, text=True, timeout=300)


def test_every_requirement_of_the_built_bundle_is_in_the_image_carried_or_excluded(manifest):
    image = closure.read_image_list(REPO / "scripts" / "sglang_gpu" / "gpu_image_packages.txt")
    sglang = manifest["sglang"]
    wheels = [(sglang["name"], sglang["version"], sglang["requires"])]
    wheels += [(w["name"], w["version"], w["requires"]) for w in manifest["wheels"]]
    assert closure.check_closure(wheels, image) == []
    used = {d["requirement"].split(";")[0] for d in manifest["decisions"] if d["verdict"] == "excluded"}
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    unused = set(closure.EXCLUDED) - {canonicalize_name(Requirement(u).name) for u in used}
    assert not unused, f"EXCLUDED entries that no requirement of the bundle names: {sorted(unused)}"


def test_the_built_bundle_is_within_50_mb_and_holds_what_its_manifest_lists(manifest):
    on_disk = {p.relative_to(ENGINE).as_posix(): p.stat().st_size for p in ENGINE.rglob("*") if p.is_file()}
    listed = {f["path"]: f["bytes"] for f in manifest["files"]}
    assert on_disk.pop("manifest.json") > 0 and on_disk == listed
    assert sum(listed.values()) == manifest["total_bytes"]  # manifest.json itself not counted there
    assert sum(listed.values()) + (ENGINE / "manifest.json").stat().st_size <= LIMIT == manifest["limit_bytes"]
    for wheel in manifest["wheels"]:
        assert listed[wheel["file"]] == wheel["bytes"]
    assert {"install.sh", manifest["sglang"]["archive"], "standin/sgl_kernel/__init__.py",
            "standin/sitecustomize.py", "standin/IPython/display.py"} <= set(listed)


@pytest.mark.slow
def test_the_builder_rebuilds_from_the_cache_and_refuses_a_bundle_over_its_limit(tmp_path):
    cache, out = warm_cache(), tmp_path / "engine"
    done = run_builder("--offline", "--cache", str(cache), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert re.findall(r"^\[build_engine\] (\d/6) ", done.stdout, re.M) == ["1/6", "2/6", "3/6", "4/6", "5/6", "6/6"]
    before = (out / "manifest.json").read_bytes()
    assert json.loads(before)["total_bytes"] + len(before) <= LIMIT

    refused = run_builder("--offline", "--cache", str(cache), "--out", str(out), "--limit-mb", "1")
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1
    assert refused.stderr.startswith("build_engine: error: the bundle is ") and "over the 1 MB limit" in refused.stderr
    assert (out / "manifest.json").read_bytes() == before and not (tmp_path / "engine.building").exists()


def test_the_builder_names_a_wheel_missing_from_the_cache_in_one_line(tmp_path):
    done = run_builder("--offline", "--cache", str(tmp_path / "empty"), "--out", str(tmp_path / "engine"))
    assert done.returncode == 1 and done.stderr.count("\n") == 1
    assert done.stderr.startswith("build_engine: error: --offline: no wheel for sglang==0.5.23 in ")


@pytest.mark.slow
def test_install_sh_installs_the_bundle_into_a_fresh_site_directory(manifest, tmp_path):
    python = python312()
    if python is None:
        pytest.skip("install.sh installs cp312 wheels: needs a Python 3.12 (python3.12 on PATH, or pyenv's)")
    site = tmp_path / "site"
    (site / "stale").mkdir(parents=True)  # what an earlier install left: removed
    done = subprocess.run(["bash", str(ENGINE / "install.sh"), str(site)], capture_output=True, text=True,
                          timeout=300, env={"PATH": "/usr/bin:/bin", "PYTHON": python, "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"export PYTHONPATH={site}"
    assert f"sglang-kernel {manifest['standin']['sglang_kernel_version']} (stand-in at {site}/sgl_kernel" in done.stderr
    assert not (site / "stale").exists()
    for name in ("sglang/srt/layers/layernorm.py", "sgl_kernel/__init__.py", "sitecustomize.py", "IPython/display.py",
                 "pydantic/__init__.py", "xgrammar/__init__.py", "tvm_ffi/__init__.py"):
        assert (site / name).is_file(), name
    assert not (site / "sglang" / "multimodal_gen").exists()
