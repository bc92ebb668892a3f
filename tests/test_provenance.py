"""Where a measurement comes from (``kvzap_export/provenance.py``): a checkout's commit, marked when a tracked file
differs from it, None outside the top of a git checkout; the command line as typed."""

import shutil
import subprocess
import sys

import pytest

from kvzap_export.provenance import DIRTY, checkout_commit, command_line

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not on PATH")


def git(root, *args):
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout.strip()


@needs_git
def test_a_checkouts_commit_is_marked_when_a_tracked_file_changed(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "a.txt").write_text("one\n")
    git(repo, "add", "a.txt")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = git(repo, "rev-parse", "--short", "HEAD")
    assert checkout_commit(repo) == head
    (repo / "b.txt").write_text("untracked\n")  # untracked files do not count
    assert checkout_commit(repo) == head
    (repo / "a.txt").write_text("two\n")
    assert checkout_commit(repo) == head + DIRTY
    (repo / "sub").mkdir()
    assert checkout_commit(repo / "sub") is None  # not the top: e.g. a wheel installed into a venv inside a checkout
    assert checkout_commit(tmp_path) is None  # no checkout at all


@needs_git
def test_this_packages_commit_is_its_checkouts():
    from kvzap_export.provenance import PACKAGE_CHECKOUT

    if checkout_commit(PACKAGE_CHECKOUT) is None:
        pytest.skip("this package does not run from the top of a git checkout")
    assert checkout_commit().startswith(git(PACKAGE_CHECKOUT, "rev-parse", "--short", "HEAD"))


def test_the_command_line_is_quoted_as_typed(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/x/bin/kvzap-export", "bench", "--engine", "sglang", "--model", "my model"])
    assert command_line() == "kvzap-export bench --engine sglang --model 'my model'"
