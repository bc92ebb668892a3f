"""Builds ``.gpu/engine/``: SGLang 0.5.23 and what it needs, for the GPU machines this project borrows, which have
no network and no SGLang, sgl-kernel or flashinfer (Python 3.12, torch 2.11 CUDA 13, the image listed in
``gpu_image_packages.txt``). Run it here, where the package index is reachable:

    python scripts/sglang_gpu/build_engine.py [--out .gpu/engine] [--cache .gpu/cache] [--limit-mb 50] [--offline]

Steps (each prints a line): read the image's package list; fetch SGLang's cp312 manylinux wheel; walk its
``Requires-Dist`` closure against the image (engine_bundle/closure.py: a requirement is in the image, carried as a
wheel, or excluded with a reason; anything else stops the build), fetching py3.12 manylinux wheels ``--no-deps``;
pack SGLang trimmed (engine_bundle/trim.py); add the CUDA stand-in for sgl-kernel (``sgl_kernel/``), the start-up
stubs (``startup/``), the stand-in's dist-info, ``install.sh`` and ``manifest.json`` (engine_bundle/layout.py); check
the total against the limit. Downloads stay in the cache folder: with a warm cache the index is not asked again
(a cached wheel that satisfies a requirement is used as is). The bundle is built beside ``--out`` and moved there
at the end, so a failed build leaves an earlier bundle as it was. On the GPU machine: ``bash .gpu/engine/install.sh``.

A maintenance tool of this repository (issue 57), not part of the ``kvzap_export`` package.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from engine_bundle import closure, layout, trim  # noqa: E402

from packaging.requirements import Requirement  # noqa: E402

REPO = HERE.parents[1]
SGLANG = Requirement("sglang==0.5.23")
# The GPU machines run CPython 3.12 on x86-64 Linux with glibc >= 2.34 (SGLang's own wheel is manylinux_2_34 and
# installed there). pip matches each --platform tag exactly, so each accepted level is named.
PLATFORMS = ("manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_26_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_5_x86_64", "manylinux1_x86_64")


class BuildError(Exception):
    """A build that cannot go on; main() prints it as one line."""


def step(message: str) -> None:
    print(f"[build_engine] {message}", flush=True)


def fetch(requirement: Requirement, cache: Path, offline: bool = False) -> Path:
    """A wheel for ``requirement`` (its name and version specifier; marker and extras aside) from the cache, else pip."""
    cached = closure.find_cached(requirement, cache)
    if cached is not None:
        return cached
    if offline:
        raise BuildError(f"--offline: no wheel for {requirement.name}{requirement.specifier} in {cache}")
    spec = f"{requirement.name}{requirement.specifier}"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
               "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none", "--disable-pip-version-check",
               "-q", "-d", str(cache)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    done = subprocess.run([*command, spec], capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BuildError(f"pip could not download a py3.12 manylinux wheel for {spec!r}: {last}")
    found = closure.find_cached(requirement, cache)
    if found is None:
        raise BuildError(f"pip downloaded {spec!r} but no matching wheel is in {cache}")
    return found


def git_commit() -> str:
    sys.path.insert(0, str(REPO))  # the checkout's package, installed or not
    from kvzap_export.provenance import checkout_commit

    return checkout_commit(REPO) or "unknown"


def build(out: Path, cache: Path, limit_bytes: int, offline: bool = False) -> dict:
    cache.mkdir(parents=True, exist_ok=True)
    image_list = HERE / "gpu_image_packages.txt"
    try:
        image = closure.read_image_list(image_list)
    except ValueError as error:  # a malformed line: name it, no traceback
        raise BuildError(str(error)) from None
    step(f"1/6 the GPU image's package list: {len(image)} packages ({image_list.relative_to(REPO)})")

    root = fetch(SGLANG, cache, offline)
    step(f"2/6 SGLang's wheel: {root.name} ({root.stat().st_size / 1e6:.1f} MB)")

    step("3/6 the requirement closure against the image (fetching what it lacks)")
    try:
        result = closure.compute_closure(root, image, lambda r: fetch(r, cache, offline), progress=step)
    except ValueError as error:  # an unreadable wheel or Requires-Dist line (closure.py names it)
        raise BuildError(str(error)) from None
    problems = result.problems()
    if problems:
        first = problems[0]
        raise BuildError(f"{len(problems)} requirement(s) not met, first: {first.requirer} needs {first.requirement!r}: "
                         f"{first.detail} (add it to EXCLUDED in engine_bundle/closure.py with a reason, or fix the pin)")
    mismatches = [d for d in result.decisions if d.verdict == "image" and "outside" in d.detail]
    step(f"    {len(result.carried)} wheels carried; {len(mismatches)} requirement(s) met by an image version outside "
         "their pin (listed in the manifest)")

    staging = out.with_name(out.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "wheels").mkdir(parents=True)
    archive = f"{closure.wheel_identity(root)[0]}-{closure.wheel_identity(root)[1]}-trimmed.tar.gz"
    report = trim.pack_trimmed(root, staging / archive)
    step(f"4/6 SGLang trimmed: {report.kept_files} files kept, "
         f"{sum(n for n, _ in report.dropped.values())} dropped -> {archive} "
         f"({(staging / archive).stat().st_size / 1e6:.1f} MB)")

    wheels = []
    for name, wheel in sorted(result.carried.items()):
        shutil.copy2(wheel, staging / "wheels" / wheel.name)
        requirers = sorted({d.requirer for d in result.decisions
                            if d.verdict == "carried" and d.detail.split(" ")[0] == name})
        wheels.append({"file": f"wheels/{wheel.name}", "name": name, "version": str(closure.wheel_identity(wheel)[1]),
                       "bytes": wheel.stat().st_size, "sha256": layout.sha256(wheel),
                       "requires": closure.wheel_requires(wheel), "required_by": requirers})
    layout.write_standin(HERE, staging / "standin")
    sglang_version = str(closure.wheel_identity(root)[1])
    layout.write_install_sh(staging, sglang_version, archive, len(wheels))
    step(f"5/6 {len(wheels)} wheels, the sgl-kernel stand-in, start-up stubs and install.sh written")

    files = layout.file_list(staging)
    total = sum(f["bytes"] for f in files)
    manifest = {
        "schema_version": 1,
        "built_by": "scripts/sglang_gpu/build_engine.py",
        "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "kvzap_export_commit": git_commit(),
        "target": {k: closure.TARGET_ENV[k] for k in ("python_full_version", "sys_platform", "platform_machine")},
        "platforms": list(PLATFORMS),
        "image_list": {"path": str(image_list.relative_to(REPO)), "sha256": layout.sha256(image_list)},
        "sglang": {"wheel": root.name, "name": "sglang", "version": sglang_version, "archive": archive,
                   "bytes": (staging / archive).stat().st_size, "wheel_bytes": root.stat().st_size,
                   "kept_files": report.kept_files, "kept_bytes": report.kept_bytes,
                   "dropped": {k: {"files": n, "bytes": b} for k, (n, b) in sorted(report.dropped.items())},
                   "requires": closure.wheel_requires(root)},
        "wheels": wheels,
        "standin": {"sglang_kernel_version": layout.STANDIN_DIST_VERSION,
                    "files": [f for f in files if f["path"].startswith("standin/")]},
        "excluded": {d.requirement: d.detail for d in result.decisions if d.verdict == "excluded"},
        "image_version_mismatches": [f"{d.requirer}: {d.requirement} ({d.detail})" for d in mismatches],
        "decisions": [vars(d) for d in result.decisions],
        "files": files,
        "limit_bytes": limit_bytes,
    }
    manifest["total_bytes"] = total  # every file but manifest.json itself, which is counted just below
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total += (staging / "manifest.json").stat().st_size
    if total > limit_bytes:
        shutil.rmtree(staging, ignore_errors=True)
        raise BuildError(f"the bundle is {total / 1e6:.1f} MB, over the {limit_bytes / 1e6:.0f} MB limit")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    step(f"6/6 {out}: {total / 1e6:.1f} MB in {len(files) + 1} files (limit {limit_bytes / 1e6:.0f} MB)")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / ".gpu" / "engine")
    parser.add_argument("--cache", type=Path, default=REPO / ".gpu" / "cache")
    parser.add_argument("--limit-mb", type=float, default=50.0, help="fail above this size, in MB of 10^6 bytes")
    parser.add_argument("--offline", action="store_true", help="use the cache only; fail if a wheel is not in it")
    args = parser.parse_args(argv)
    try:
        build(args.out.resolve(), args.cache.resolve(), int(args.limit_mb * 1e6), args.offline)
    except BuildError as error:
        print(f"build_engine: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
