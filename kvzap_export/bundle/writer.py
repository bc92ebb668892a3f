"""Atomic bundle writes.

Everything is written into a temporary sibling directory ``.<name>.tmp-<pid>``; on success the
manifest is fsynced and the directory renamed over ``--out``. A failed or interrupted run leaves an
existing bundle untouched, and the next run removes temporary siblings left by a killed run.
A lock file beside ``--out`` stops two runs from writing the same bundle at once.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import TracebackType

from kvzap_export.bundle.manifest import MANIFEST_NAME, sha256_file, write_json_durably
from kvzap_export.errors import BundleError


class BundleWriter:
    """``with BundleWriter(out, force) as w: ...write under w.tmp...; w.commit(manifest)``."""

    def __init__(self, out: str | os.PathLike, force: bool = False):
        self.out = Path(out).expanduser().absolute()
        self.force = force
        self.tmp: Path = self.out.parent / f".{self.out.name}.tmp-{os.getpid()}"
        self._lock = None
        self._committed = False

    def _check_target(self) -> None:
        out = self.out
        if out.exists() and not out.is_dir():
            raise BundleError(f"--out {out}: exists and is not a directory; choose a directory path")
        parent = out.parent
        if not parent.is_dir():
            raise BundleError(f"--out {out}: parent directory {parent} does not exist; create it first")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise BundleError(f"--out {out}: no write permission in {parent}; choose a writable location")

    def __enter__(self) -> "BundleWriter":
        from filelock import FileLock, Timeout

        self._check_target()
        lock_path = self.out.parent / f".{self.out.name}.lock"
        self._lock = FileLock(str(lock_path))
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            raise BundleError(f"--out {self.out}: another kvzap-export run is writing this bundle (lock {lock_path}); wait for it") from None
        except OSError as exc:
            raise BundleError(f"--out {self.out}: cannot create lock file {lock_path} ({exc.strerror})") from None
        if self.out.is_dir() and any(self.out.iterdir()) and not self.force:
            self._release()
            raise BundleError(f"--out {self.out}: directory is not empty; pass --force to replace it or choose another path")
        # We hold the lock: any temporary sibling left for this --out is from a dead run.
        for stale in self.out.parent.glob(f".{self.out.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        for stale in self.out.parent.glob(f".{self.out.name}.old-*"):
            shutil.rmtree(stale, ignore_errors=True)
        try:
            self.tmp.mkdir()
        except OSError as exc:
            self._release()
            raise BundleError(f"--out {self.out}: cannot create {self.tmp} ({exc.strerror})") from None
        return self

    def path(self, relative: str) -> Path:
        """Absolute path of ``relative`` inside the bundle under construction (parents created)."""
        target = self.tmp / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        return target

    def hash_artifacts(self, manifest: dict) -> None:
        """Fills ``sha256`` of every artifact and of the surrogate copy from the files written."""
        for artifact in manifest.get("artifacts", []):
            artifact["sha256"] = sha256_file(self.tmp / artifact["path"])
        files = {}
        for path in sorted(self.tmp.rglob("*")):
            if path.is_file() and path.name != MANIFEST_NAME:
                files[path.relative_to(self.tmp).as_posix()] = sha256_file(path)
        manifest["files"] = files

    def commit(self, manifest: dict) -> Path:
        """Hashes, writes the manifest durably and moves the bundle into place."""
        self.hash_artifacts(manifest)
        write_json_durably(self.tmp / MANIFEST_NAME, manifest)
        backup = None
        if self.out.exists():
            backup = self.out.parent / f".{self.out.name}.old-{os.getpid()}"
            os.rename(self.out, backup)
        try:
            os.rename(self.tmp, self.out)
        except OSError:
            if backup is not None:
                os.rename(backup, self.out)
            raise
        if backup is not None:
            shutil.rmtree(backup, ignore_errors=True)
        _fsync_dir(self.out.parent)
        self._committed = True
        return self.out

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if not self._committed:
                shutil.rmtree(self.tmp, ignore_errors=True)
        finally:
            self._release()


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
