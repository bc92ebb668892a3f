"""Small synthetic wheels for the bundle-builder tests: a zip with a ``*.dist-info/METADATA`` and any other files."""

from __future__ import annotations

import zipfile
from pathlib import Path


def make_wheel(folder: Path, name: str, version: str, requires: list[str] = (), files: dict[str, bytes] | None = None,
               tag: str = "py3-none-any") -> Path:
    """Writes ``folder/<name>-<version>-<tag>.whl``; ``files`` maps paths inside the wheel to their bytes."""
    stem = name.replace("-", "_")
    metadata = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                        *(f"Requires-Dist: {line}\n" for line in requires)])
    path = Path(folder) / f"{stem}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{stem}-{version}.dist-info/METADATA", metadata)
        for inner, data in (files or {}).items():
            archive.writestr(inner, data)
    return path
