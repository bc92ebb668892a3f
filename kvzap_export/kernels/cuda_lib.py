"""The CUDA C kernels of ``plugins/`` (``libkvzap_kernels.so``, C ABI in ``plugins/include/kvzap/compaction.h``)
called from Python on torch CUDA tensors.

- ``build_kernel_library(out)`` compiles ``plugins/src/compaction.cu`` with nvcc: machine code (SASS) for sm_80
  and sm_90 by default, plus the PTX of the newest one, which the driver compiles for GPUs newer than every
  SASS (Blackwell and later); without it the library would not load there.
  It needs a source checkout: ``plugins/`` is not part of the installed package; CMake
  (``cmake -S plugins -B build``) builds the same library.
- ``CudaKernels(path)`` loads a built library with ctypes. ``threshold_compaction`` / ``kv_compaction`` have
  the contract, errors and outputs of ``kvzap_export.ops`` (validated inputs); ``launch_*`` skip the
  validation and never synchronize with the host (benchmarks, engines that validated already).
  ``threshold_compaction_grid`` says how the decision launch splits rows into tiles (host arithmetic: the library
  loads and answers without a GPU, since nvcc links the CUDA runtime statically).

Used by tests/plugins/test_cuda_kernels.py (exactness on a GPU) and scripts/bench_kernels.py (timings).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import torch

from kvzap_export.errors import ConfigError, InputError, MissingDependencyError
from kvzap_export.ops.compaction import Compaction, check_inputs, check_kv_inputs

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
SOURCE = PLUGINS / "src" / "compaction.cu"
ARCHITECTURES = ("80", "90")
ABI = ("kvzap_threshold_compaction", "kvzap_threshold_compaction_grid", "kvzap_kv_compaction")
# enum KvzapDtype of compaction.h
SCORE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
KEEP_DTYPES = {torch.bool: 3, torch.int32: 4}


def nvcc_command(out: Path, architectures=ARCHITECTURES, nvcc: str = "nvcc") -> list[str]:
    """The nvcc line that builds the library: -O3, position independent, one cubin per architecture and the
    PTX of the newest (CMake's ``80-real;90`` in plugins/CMakeLists.txt)."""
    newest = max(architectures, key=int)
    gencode = [flag for arch in architectures for flag in ("-gencode", f"arch=compute_{arch},code=sm_{arch}")]
    gencode += ["-gencode", f"arch=compute_{newest},code=compute_{newest}"]
    return [nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC,-Wall,-Wextra", "-shared", f"-I{PLUGINS / 'include'}",
            *gencode, str(SOURCE), "-o", str(out)]


def build_kernel_library(out: Path, architectures=ARCHITECTURES) -> Path:
    """Compiles the kernel library to ``out`` (a .so path); returns it."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise MissingDependencyError("building the CUDA kernels needs nvcc (the CUDA toolkit) on PATH")
    if not SOURCE.is_file():
        raise ConfigError(f"{SOURCE} not found: the CUDA kernels build from a source checkout of kvzap-export "
                          "(plugins/ is not installed with the package)")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(nvcc_command(out, architectures, nvcc), capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"nvcc failed to build {out.name}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return out


def _require_cuda(*tensors: torch.Tensor) -> torch.device:
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise InputError(f"the CUDA kernels take tensors on one CUDA device, got {sorted(str(d) for d in devices)}")
    return next(iter(devices))


class CudaKernels:
    """ctypes binding of one built ``libkvzap_kernels.so``."""

    def __init__(self, library: str | Path):
        path = Path(library)
        if not path.is_file():
            raise ConfigError(f"{path}: no such kernel library; build it with build_kernel_library() or "
                              "`cmake -S plugins -B build && cmake --build build`")
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        p, i = ctypes.c_void_p, ctypes.c_int
        decide = self.lib.kvzap_threshold_compaction
        decide.argtypes = [p, i, p, p, p, i, i, i, i, p, i, p, p, p]
        decide.restype = i
        grid = self.lib.kvzap_threshold_compaction_grid
        grid.argtypes = [i, i, i, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)]
        grid.restype = i
        move = self.lib.kvzap_kv_compaction
        move.argtypes = [p, p, p, i, i, i, i, i, p, p, p]
        move.restype = i

    @staticmethod
    def _check(status: int, name: str) -> None:
        if status != 0:
            torch.cuda.check_error(status)  # raises torch's CudaError with CUDA's own message
            raise RuntimeError(f"{name} returned {status}")

    # ---- threshold compaction ------------------------------------------------------------------
    def threshold_compaction_grid(self, batch: int, heads: int, seq: int) -> tuple[int, int]:
        """(CUDA blocks of the decision launch, positions of a row per block) for these sizes; no GPU needed.
        Raises ``InputError`` for sizes the launch refuses."""
        blocks, span = ctypes.c_int64(), ctypes.c_int64()
        status = self.lib.kvzap_threshold_compaction_grid(batch, heads, seq, ctypes.byref(blocks), ctypes.byref(span))
        if status != 0:
            raise InputError(f"the CUDA decision kernel cannot launch batch={batch}, heads={heads}, seq={seq}")
        return blocks.value, span.value

    def launch_threshold_compaction(self, scores: torch.Tensor, lengths: torch.Tensor, threshold: torch.Tensor,
                                    window: torch.Tensor, sink: int = 0, keep_dtype: torch.dtype = torch.bool,
                                    out: Compaction | None = None) -> Compaction:
        """No validation, no host sync. scores: contiguous (batch, heads, seq) float on the GPU; lengths: int32
        (batch,); threshold: float32 scalar tensor and window: int32 scalar tensor, on the same GPU (read on the
        device, as TensorRT hands them over). keep_dtype: torch.bool or torch.int32 (TensorRT plugins); ``out``
        (optional, contiguous, keep of keep_dtype) receives the result."""
        batch, heads, seq = scores.shape
        if out is None:
            out = Compaction(torch.empty((batch, heads, seq), dtype=keep_dtype, device=scores.device),
                             torch.empty((batch, heads), dtype=torch.int32, device=scores.device),
                             torch.empty((batch, heads, seq), dtype=torch.int32, device=scores.device))
        keep, counts, indices = out
        status = self.lib.kvzap_threshold_compaction(
            scores.data_ptr(), SCORE_DTYPES[scores.dtype], lengths.data_ptr(), threshold.data_ptr(), window.data_ptr(),
            batch, heads, seq, sink, keep.data_ptr(), KEEP_DTYPES[keep_dtype], counts.data_ptr(), indices.data_ptr(),
            torch.cuda.current_stream(scores.device).cuda_stream)
        self._check(status, "kvzap_threshold_compaction")
        return out

    def threshold_compaction(self, scores: torch.Tensor, lengths: torch.Tensor, threshold, window, sink=0,
                             keep_dtype: torch.dtype = torch.bool) -> Compaction:
        """Same contract, errors and outputs as ``kvzap_export.ops.threshold_compaction`` (keep as keep_dtype)."""
        tau, win, snk = check_inputs(scores, lengths, threshold, window, sink)
        device = _require_cuda(scores, lengths)
        if scores.dtype not in SCORE_DTYPES:
            raise InputError(f"the CUDA kernel takes float32/float16/bfloat16 scores, got {scores.dtype}")
        if keep_dtype not in KEEP_DTYPES:
            raise InputError(f"keep_dtype must be torch.bool or torch.int32, got {keep_dtype}")
        return self.launch_threshold_compaction(
            scores.contiguous(), lengths.to(torch.int32).contiguous(), torch.tensor(tau, dtype=torch.float32, device=device),
            torch.tensor(win, dtype=torch.int32, device=device), snk, keep_dtype)

    # ---- K/V move ------------------------------------------------------------------------------
    def launch_kv_compaction(self, keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor,
                             out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """No validation, no host sync. keys, values: contiguous (batch, heads, seq, head_dim); indices: int32
        (batch, heads, seq); ``out`` (optional, must not alias the inputs) receives the result."""
        keys_out, values_out = out if out is not None else (torch.empty_like(keys), torch.empty_like(values))
        batch, heads, seq, head_dim = keys.shape
        status = self.lib.kvzap_kv_compaction(
            keys.data_ptr(), values.data_ptr(), indices.data_ptr(), batch, heads, seq, head_dim, keys.element_size(),
            keys_out.data_ptr(), values_out.data_ptr(), torch.cuda.current_stream(keys.device).cuda_stream)
        self._check(status, "kvzap_kv_compaction")
        return keys_out, values_out

    def kv_compaction(self, keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Same contract and outputs as ``kvzap_export.ops.kv_compaction``; an index past the sequence is refused
        (the reference cannot gather it; the kernel itself would give a zero row and read nothing)."""
        check_kv_inputs(keys, values, indices)
        seq = keys.shape[2]
        if indices.numel() and int(indices.max()) >= seq:
            raise InputError(f"indices must be below seq={seq} (-1 for none), got {int(indices.max())}")
        _require_cuda(keys, values, indices)
        if keys.dtype != values.dtype or keys.element_size() not in (2, 4):
            raise InputError(f"the CUDA kernel moves 2- or 4-byte elements of one dtype, got {keys.dtype} and {values.dtype}")
        return self.launch_kv_compaction(keys.contiguous(), values.contiguous(), indices.to(torch.int32).contiguous())
