"""Threshold compaction at long sequences (batch 1, 8 KV heads): the torch reference, ONNX Runtime's std-ops graph and
plugin node (CPU), and on a GPU the fused kernels as an engine launches them (Triton; the CUDA library of
``plugins/``, built with nvcc), no validation and no host sync. A backend this machine cannot run keeps its row, with
``skipped`` and the reason (onnxruntime-extensions absent, no GPU, no nvcc)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from kvzap_export.bench.timing import measure, measure_cuda

LENGTHS = (4096, 32768, 131072)
KV_HEADS = 8  # Llama-3.1-8B


def _inputs(seq: int, device: str = "cpu"):
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(1, KV_HEADS, seq, generator=gen) * 2 - 7
    lengths = torch.tensor([seq], dtype=torch.int32)
    return scores.to(device), lengths.to(device)


def _ort_runners(directory: Path) -> dict:
    """Name -> an activated ONNX Runtime runner, or why it cannot run here."""
    from kvzap_export.errors import MissingDependencyError
    from kvzap_export.export.compaction_onnx import export_compaction_artifacts
    from kvzap_export.runners.onnxrt_runner import OnnxrtRunner

    artifacts = {a["kind"]: directory / a["path"] for a in export_compaction_artifacts(directory, KV_HEADS, 128, "float32", 20)}
    runners: dict = {}
    for name, kind, custom in (("ort_std_ops", "threshold_compaction", False),
                               ("ort_plugin_node", "threshold_compaction_plugin", True)):
        runner = OnnxrtRunner(artifacts[kind], custom_ops=custom)
        try:
            runner.activate()
        except MissingDependencyError as exc:
            runners[name] = str(exc)
            continue
        runners[name] = runner
    return runners


def _gpu_launchers(seq: int, threshold: float, window: int) -> dict:
    """Name -> a callable launching a fused kernel on the GPU (or why it cannot run)."""
    scores, lens = _inputs(seq, "cuda")
    out: dict = {}
    try:
        from kvzap_export.kernels.triton_compaction import launch_threshold_compaction, triton_threshold_compaction
    except ImportError as exc:
        out["triton_kernel"] = out["triton_validated"] = f"triton is not importable ({exc.name})"
    else:
        out["triton_kernel"] = lambda: launch_threshold_compaction(scores, lens, threshold, window)
        out["triton_validated"] = lambda: triton_threshold_compaction(scores, lens, threshold, window)
    from kvzap_export.validate.device import cuda_kernels

    lib = cuda_kernels("cuda")
    if isinstance(lib, str):
        out["cuda_kernel"] = lib
    else:
        tau = torch.tensor(threshold, dtype=torch.float32, device="cuda")
        win = torch.tensor(window, dtype=torch.int32, device="cuda")
        out["cuda_kernel"] = lambda: lib.launch_threshold_compaction(scores, lens, tau, win)
    return out


def bench_compaction(device: str = "cpu", lengths=LENGTHS, threshold: float = -7.0, window: int = 128) -> list[dict]:
    from kvzap_export.ops import threshold_compaction

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runners = _ort_runners(Path(tmp))
        try:
            for seq in lengths:
                scores, lens = _inputs(seq)
                feed = {"scores": scores.numpy(), "lengths": lens.numpy(), "threshold": np.array(threshold, np.float32),
                        "window": np.array(window, np.int32)}
                results: dict = {"torch_reference": measure(lambda: threshold_compaction(scores, lens, threshold, window))}
                for name, runner in runners.items():
                    results[name] = runner if isinstance(runner, str) else measure(lambda r=runner: r.infer(feed))
                if device == "cuda":
                    from kvzap_export.ops.compaction import indices_from_keep, keep_mask

                    gpu_scores, gpu_lens = _inputs(seq, "cuda")
                    # the reference's computation without its input checks (they read lengths back to the host),
                    # as bench_kernels.py times it: the kernels below skip them too
                    results["torch_reference_gpu"] = measure_cuda(
                        lambda: indices_from_keep(keep_mask(gpu_scores, gpu_lens, threshold, window, 0)))
                    for name, launch in _gpu_launchers(seq, threshold, window).items():
                        results[name] = launch if isinstance(launch, str) else measure_cuda(launch)
                else:
                    for name in ("triton_kernel", "cuda_kernel"):
                        results[name] = "needs a CUDA GPU (bench --device cuda)"
                for backend, timing in results.items():
                    on_gpu = backend not in ("torch_reference", *runners)
                    row = {"benchmark": "compaction", "seq": seq, "kv_heads": KV_HEADS, "backend": backend,
                           "device": "cuda" if on_gpu else "cpu"}
                    if isinstance(timing, str):
                        rows.append({**row, "skipped": timing})
                        continue
                    # against the torch reference on the same device (on the GPU without its input checks)
                    reference = results["torch_reference_gpu" if on_gpu else "torch_reference"]["median_s"]
                    rows.append({**row, "median_s": timing["median_s"],
                                 "speedup_vs_torch_reference": reference / timing["median_s"]})
        finally:
            for runner in runners.values():
                if not isinstance(runner, str):
                    runner.deactivate()
    return rows
