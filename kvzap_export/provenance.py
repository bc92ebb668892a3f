"""Where a measurement comes from: the commit of the checkout this package runs from, and the command that ran.

Benchmark records (``kvzap-export bench``) and the GPU check's scripts write them beside their figures, so that a record
names its own commit (docs/benchmarks.md). A package installed from a wheel, or a tree whose git metadata is not its
own, has no commit to give: None.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

PACKAGE_CHECKOUT = Path(__file__).resolve().parents[1]  # an editable install's (or a plain checkout's) root
DIRTY = "+uncommitted changes"


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def checkout_commit(root: str | Path | None = None) -> str | None:
    """The short commit of the git checkout whose top is ``root`` (default: this package's), with ``DIRTY`` appended
    when a tracked file differs from it; None where ``root`` is not the top of a git checkout (e.g. a wheel installed
    into a virtual environment that itself lies inside some checkout)."""
    root = Path(PACKAGE_CHECKOUT if root is None else root).resolve()
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root:
        return None
    head = _git(root, "rev-parse", "--short", "HEAD")
    if not head:
        return None
    changes = _git(root, "status", "--porcelain", "--untracked-files=no")
    return head + (DIRTY if changes else "")


def command_line(program: str = "kvzap-export") -> str:
    """This process's command line as a user would type it (``program`` and the arguments, shell-quoted)."""
    return shlex.join([program, *sys.argv[1:]])
