"""SGLang's wheel, trimmed to what the engine imports, packed as a tar.gz that unpacks into a site directory.

Dropped (each rule with why): the diffusion engine ``sglang/multimodal_gen/`` (its own server, never imported by
``sglang.srt``), ``sglang/test/`` and ``sglang/benchmark/`` (test and benchmark helpers), the four Rust extensions
that only the Rust/gRPC front ends load (``srt/rust_extensions/_grpc``, ``_bench``, ``_multimodal``, ``_server``; the
radix tree's ``rust_tree_core`` stays), and any ``__pycache__``. The ``sglang-*.dist-info`` directory is kept, so
``importlib.metadata.version("sglang")`` answers, with one file added: ``kvzap_trimmed.txt`` names what was dropped.
"""

from __future__ import annotations

import gzip
import io
import tarfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

DROP_RULES: tuple[tuple[str, str], ...] = (
    ("sglang/multimodal_gen/", "diffusion engine, not imported by sglang.srt"),
    ("sglang/test/", "SGLang's test helpers"),
    ("sglang/benchmark/", "SGLang's benchmark helpers"),
    ("sglang/srt/rust_extensions/_grpc.", "Rust gRPC front end"),
    ("sglang/srt/rust_extensions/_bench.", "Rust benchmark front end"),
    ("sglang/srt/rust_extensions/_multimodal.", "Rust multimodal front end"),
    ("sglang/srt/rust_extensions/_server.", "Rust HTTP server front end"),
)

NOTE_NAME = "kvzap_trimmed.txt"


@dataclass
class TrimReport:
    kept_files: int = 0
    kept_bytes: int = 0
    dropped: dict[str, list[int]] = field(default_factory=dict)  # rule prefix -> [files, bytes]


def drop_reason(member: str) -> str | None:
    """Why ``member`` (a path inside the wheel) is dropped, or None if it is kept."""
    if "/__pycache__/" in f"/{member}":
        return "__pycache__"
    for prefix, _ in DROP_RULES:
        if member.startswith(prefix):
            return prefix
    return None


def _dist_info(names: list[str]) -> str:
    found = sorted({n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info")})
    if len(found) != 1:
        raise ValueError(f"expected one .dist-info directory in the wheel, found {found}")
    return found[0]


def _add(tar: tarfile.TarFile, name: str, data: bytes, mode: int) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 0  # mtime 0: the same wheel packs to the same bytes
    tar.addfile(info, io.BytesIO(data))


def pack_trimmed(wheel: Path, out: Path) -> TrimReport:
    """Writes ``out`` (tar.gz) holding the kept members of ``wheel`` under their wheel paths; returns what it did."""
    report = TrimReport()
    with zipfile.ZipFile(wheel) as archive:
        infos = [i for i in archive.infolist() if not i.is_dir()]
        dist_info = _dist_info([i.filename for i in infos])
        # gzip with no name and time in its header: the same wheel packs to the same bytes
        with open(out, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as packed, \
                tarfile.open(fileobj=packed, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for info in sorted(infos, key=lambda i: i.filename):
                reason = drop_reason(info.filename)
                if reason is not None:
                    files_bytes = report.dropped.setdefault(reason, [0, 0])
                    files_bytes[0] += 1
                    files_bytes[1] += info.file_size
                    continue
                mode = (info.external_attr >> 16) & 0o777 or 0o644
                _add(tar, info.filename, archive.read(info), mode)
                report.kept_files += 1
                report.kept_bytes += info.file_size
            reasons = dict(DROP_RULES) | {"__pycache__": "byte-code caches"}
            note = "".join(f"{prefix}\t{files} files\t{size} bytes\t{reasons[prefix]}\n"
                           for prefix, (files, size) in sorted(report.dropped.items()))
            header = f"Dropped from {Path(wheel).name} by kvzap-export's scripts/sglang_gpu/build_engine.py:\n"
            _add(tar, f"{dist_info}/{NOTE_NAME}", (header + note).encode(), 0o644)
    return report
