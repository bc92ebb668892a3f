"""AOT compilation needs real ``triton.jit`` kernels, so it runs in a child without TRITON_INTERPRET."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install 'kvzap-export[gpu]')")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_aot_compilation_for_sm80_and_sm90():
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # tests/conftest.py leaves an explicit value alone
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/kernels/test_triton_compaction.py", "-k", "aot"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "6 passed" in done.stdout
