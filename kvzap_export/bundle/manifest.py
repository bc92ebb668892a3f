"""``manifest.json``: keys are a contract (DESIGN.md, "The bundle"); add freely, never rename."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from kvzap_export.errors import BundleError

MANIFEST_NAME = "manifest.json"
SCHEMA_VERSION = 1
_TOOLS = ("torch", "onnx", "onnxruntime", "onnxscript", "onnxruntime-extensions", "transformers", "kvpress", "triton", "polygraphy")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def tool_versions() -> dict[str, str | None]:
    """Installed versions of the tools that shape the artifacts (None when absent)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in _TOOLS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    try:  # TensorRT is recorded by the build stage when it runs; here only whether it is importable.
        versions["tensorrt"] = metadata.version("tensorrt")
    except metadata.PackageNotFoundError:
        versions["tensorrt"] = None
    return versions


# Sections whose content decides what the bundle does; their digests are recorded at export so an
# edit made afterwards (say, of pruning.threshold) is caught by verify/validate.
INTEGRITY_SECTIONS = ("model", "surrogate", "pruning", "dtype", "opset", "artifacts")


def section_digests(manifest: dict[str, Any]) -> dict[str, str]:
    return {
        key: hashlib.sha256(json.dumps(manifest.get(key), sort_keys=True).encode()).hexdigest()
        for key in INTEGRITY_SECTIONS
    }


def integrity_problems(manifest: dict[str, Any]) -> list[str]:
    recorded = manifest.get("integrity")
    if not isinstance(recorded, dict):
        return ["manifest has no integrity digests; re-export the bundle"]
    now = section_digests(manifest)
    return [f"manifest section '{key}' was edited after export (digest mismatch)" for key in INTEGRITY_SECTIONS
            if recorded.get(key) != now[key]]


def write_json_durably(path: Path, data: Any) -> None:
    """Writes JSON and fsyncs it, so a crash right after cannot leave a truncated manifest."""
    payload = json.dumps(data, indent=2) + "\n"
    with open(path, "w") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())


def read_manifest(bundle: str | os.PathLike) -> dict[str, Any]:
    path = Path(bundle) / MANIFEST_NAME
    if not Path(bundle).is_dir():
        raise BundleError(f"{bundle}: not a bundle directory; pass the --out directory of a kvzap-export run")
    if not path.is_file():
        raise BundleError(f"{bundle}: no {MANIFEST_NAME}; not a kvzap-export bundle (re-run the export)")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BundleError(f"{path}: unreadable manifest ({exc}); re-run the export") from None
    if not isinstance(data, dict) or "schema_version" not in data:
        raise BundleError(f"{path}: not a kvzap-export manifest (no schema_version)")
    if data["schema_version"] != SCHEMA_VERSION:
        raise BundleError(f"{path}: schema_version {data['schema_version']!r}, this tool reads {SCHEMA_VERSION}; re-export with this version")
    return data
