"""The CUDA stand-in for sgl-kernel against SGLang 0.5.23 itself, in the SGLang environment ($KVZAP_SGLANG_PYTHON),
on the CPU:

- each op it implements equals SGLang's own torch implementation of that layer (``RMSNorm.forward_native``,
  ``SiluAndMul.forward_native``), float32 and bf16, residual variants (``standin_vs_native.py``); deliberately wrong
  references (10x epsilon, swapped SiLU halves, an unchanged residual) are told apart, so the comparison can fail;
- SGLang's CUDA-path modules import with the bundle's start-up (stand-in, stubs) in an emulation of the GPU image's
  package set, and SGLang's own dispatch (``forward`` -> ``forward_cuda``) reaches the stand-in's ops and matches
  ``forward_native`` (``scripts/sglang_gpu/emulate_gpu_imports.py``; torch answers as if a GPU were there).

What only a GPU shows (the JIT kernels' builds, CUDA graphs, the ops SGLang calls at run time) is not tested here.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import sglang_python

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
GPU_DIR = REPO / "scripts" / "sglang_gpu"


def run_in_sglang_env(*args: str, **env: str) -> dict:
    done = subprocess.run([sglang_python(), *args], capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, **env})
    assert done.stdout.strip(), done.stderr[-3000:]
    report = json.loads(done.stdout)
    report["returncode"] = done.returncode
    return report


def test_each_stand_in_op_equals_sglangs_own_torch_implementation():
    report = run_in_sglang_env(str(Path(__file__).with_name("standin_vs_native.py")), PYTHONPATH=str(GPU_DIR))
    assert Path(report["standin"]).parent == GPU_DIR / "sgl_kernel"  # the CUDA stand-in, not the CPU one
    cases, power = report["cases"], report["power"]
    assert len(cases) == 28 and len(power) == 8
    assert {name for name, ratio in cases.items() if not ratio <= 1.0} == set(), cases
    assert {name for name, ratio in power.items() if not ratio > 1.0} == set(), power


def emulate(*args: str, **env: str) -> dict:
    manifest = REPO / ".gpu" / "engine" / "manifest.json"
    found = ["--manifest", str(manifest)] if manifest.is_file() else []
    return run_in_sglang_env(str(GPU_DIR / "emulate_gpu_imports.py"), *args, *found, **env)


JIT_CALLS = ("silu_and_mul, 16-byte-aligned width", "rotary, head 128", "rotary, head 80", "clamp_position")
JIT_PROBES = ("qk-norm, Qwen3", "KV store, set_kv_buffer")


def test_sglangs_cuda_path_imports_and_dispatches_to_the_stand_in_with_the_bundles_startup():
    report = emulate("--dispatch", "--jit-paths")
    assert report["failed"] == {} and report["returncode"] == 0
    assert "sglang.srt.models.qwen3" in report["imported"] and "sglang.srt.entrypoints.engine" in report["imported"]
    assert "ipython" in report["hidden"]  # SGLang's `from IPython.display import ...` met the stand-in module
    assert {name.partition(".")[0] for name in report["stubbed"]} == {"cutlass"}
    assert set(report["dispatch"]) == {f"{op}_{dtype}" for op in ("rmsnorm", "fused_add_rmsnorm", "silu_and_mul")
                                       for dtype in ("float32", "bfloat16")}
    assert all(ratio <= 1.0 for ratio in report["dispatch"].values()), report["dispatch"]
    # Where SGLang 0.5.23 builds kernels of its own on CUDA instead of calling sgl-kernel (no stand-in can serve those)
    paths = report["jit_paths"]
    assert sorted(next(k for k in paths if k.startswith(p)) for p in JIT_CALLS + JIT_PROBES) == sorted(paths)
    assert all(paths[k].startswith("jit: ") for k in paths if k.startswith(JIT_CALLS)), paths
    assert all(paths[k] == "jit-probe -> fallback to torch" for k in paths if k.startswith(JIT_PROBES)), paths


def test_sglangs_torch_backend_switch_routes_the_jit_calls_to_torch():
    """SGLANG_FORCE_FUSED_OP_BACKEND=torch: SGLang's fused ops run their forward_native, the JIT calls above included
    (and RMSNorm/SiluAndMul too, so the stand-in's ops are not reached: the dispatch check says so)."""
    report = emulate("--dispatch", "--jit-paths", SGLANG_FORCE_FUSED_OP_BACKEND="torch")
    assert list(report["failed"]) == ["--dispatch"] and "stand-in calls through SGLang's dispatch: {}" in \
        report["failed"]["--dispatch"]
    paths = report["jit_paths"]
    assert all(paths[k] == "torch" for k in paths if k.startswith(JIT_CALLS)) and len(paths) == 6, paths
