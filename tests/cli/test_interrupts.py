"""Interrupted and concurrent exports: the previous bundle survives, nothing half-written remains."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvzap_export.bundle.verify import verify_bundle
from kvzap_export.bundle.writer import lock_path_for
from tests.helpers import preset_with_checkpoint

# Big enough that an export takes a few seconds, so a signal lands mid-export.
MEDIUM = "name: medium\nhidden_size: 2048\nnum_layers: 24\nnum_attention_heads: 16\nnum_kv_heads: 4\nhead_dim: 128\n"


@pytest.fixture(scope="module")
def medium(tmp_path_factory):
    root = tmp_path_factory.mktemp("interrupt")
    return preset_with_checkpoint(root, MEDIUM)


def _start(preset, weights, out, *extra):
    cmd = [sys.executable, "-m", "kvzap_export.cli.main", "--model", str(preset), "--weights", str(weights),
           "--out", str(out), "--quiet", *extra]
    # A harness that runs the tests in the background may have SIGINT ignored; the export gets the default, as a
    # user's terminal gives it (Python installs its KeyboardInterrupt handler only where SIGINT is not ignored).
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for_onnx_in_tmp(parent: Path, name: str, proc, timeout=120.0):
    """Waits until the run has started writing ONNX files into its temporary directory."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for tmp in parent.glob(f".{name}.tmp-*"):
            if any((tmp / "onnx").glob("*.onnx")):
                return tmp
        if proc.poll() is not None:
            raise AssertionError(f"export ended before it could be interrupted: {proc.communicate()}")
        time.sleep(0.05)
    raise AssertionError("export never started writing")


def _export_ok(preset, weights, out, *extra):
    proc = _start(preset, weights, out, *extra)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 3, err  # written; validation incomplete (no model ships for this preset)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_interrupted_export_keeps_previous_bundle(medium, tmp_path, sig):
    preset, weights = medium
    out = tmp_path / "engine"
    _export_ok(preset, weights, out)
    before = (out / "manifest.json").read_bytes()

    proc = _start(preset, weights, out, "--force")
    _wait_for_onnx_in_tmp(tmp_path, "engine", proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    if sig == signal.SIGINT:
        assert proc.returncode == 130
        assert "interrupted" in err and "Traceback" not in err
        assert list(tmp_path.glob(".engine.tmp-*")) == []  # cleaned up on the way out
    else:
        assert proc.returncode == -signal.SIGKILL
    assert (out / "manifest.json").read_bytes() == before
    assert verify_bundle(out) == []

    _export_ok(preset, weights, out, "--force")  # the next run sweeps what a killed run left
    assert list(tmp_path.glob(".engine.tmp-*")) == [] and list(tmp_path.glob(".engine.old-*")) == []
    assert verify_bundle(out) == []


@pytest.mark.slow
def test_concurrent_exports_one_wins(medium, tmp_path):
    preset, weights = medium
    out = tmp_path / "engine"
    first = _start(preset, weights, out)
    _wait_for_onnx_in_tmp(tmp_path, "engine", first)
    second = _start(preset, weights, out)
    _, err2 = second.communicate(timeout=300)
    _, err1 = first.communicate(timeout=300)
    assert first.returncode == 3, err1  # written, validation incomplete
    assert second.returncode == 2
    # Either it met the lock, or it started after the first had finished and met the bundle.
    assert ("another kvzap-export run is writing" in err2 or "pass --force" in err2) and err2.count("\n") == 1
    assert verify_bundle(out) == []


def test_held_lock_refuses_second_writer(tmp_path, capsys):
    from kvzap_export.cli.main import main

    preset, weights = preset_with_checkpoint(tmp_path, "name: p\nhidden_size: 64\nnum_layers: 2\nnum_attention_heads: 4\nnum_kv_heads: 2\nhead_dim: 16\n")
    # Another process holds the lock, as a concurrent run does while it writes.
    holder = subprocess.Popen([sys.executable, "-c", "import sys, filelock; l = filelock.FileLock(sys.argv[1]); l.acquire(); "
                               "print('held', flush=True); sys.stdin.read()", str(lock_path_for(tmp_path / "engine"))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        code = main(["--model", str(preset), "--weights", str(weights), "--out", str(tmp_path / "engine")])
    finally:
        holder.communicate("")
    err = capsys.readouterr().err
    assert code == 2 and "another kvzap-export run is writing" in err and err.count("\n") == 1
    assert not (tmp_path / "engine").exists() and list(tmp_path.glob(".engine.tmp-*")) == []


@pytest.fixture
def tiny_disk(tmp_path):
    """A 256 KiB tmpfs (root only: mount needs privileges)."""
    target = tmp_path / "disk"
    target.mkdir()
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a size-limited tmpfs")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(target)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs: {done.stderr.decode().strip()}")
    yield target
    subprocess.run(["umount", str(target)], check=False)


def test_out_of_disk_space(tmp_path, tiny_disk, capsys):
    from kvzap_export.cli.main import main

    preset, weights = preset_with_checkpoint(tmp_path, "name: p\nhidden_size: 256\nnum_layers: 4\nnum_attention_heads: 4\nnum_kv_heads: 2\nhead_dim: 64\n")
    code = main(["--model", str(preset), "--weights", str(weights), "--out", str(tiny_disk / "engine"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "no space left" in err and err.count("\n") == 1
    assert list(tiny_disk.iterdir()) == []
