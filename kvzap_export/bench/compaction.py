"""Threshold compaction at long sequences: ORT std-ops graph, ORT plugin node, torch reference (+ GPU kernels)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from kvzap_export.bench.timing import measure

LENGTHS = (4096, 32768, 131072)
KV_HEADS = 8  # Llama-3.1-8B


def _inputs(seq: int, device: str = "cpu"):
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(1, KV_HEADS, seq, generator=gen) * 2 - 7
    lengths = torch.tensor([seq], dtype=torch.int32)
    return scores.to(device), lengths.to(device)


def bench_compaction(device: str = "cpu", lengths=LENGTHS, threshold: float = -7.0, window: int = 128) -> list[dict]:
    from kvzap_export.export.compaction_onnx import export_compaction_artifacts
    from kvzap_export.ops import threshold_compaction
    from kvzap_export.runners.onnxrt_runner import OnnxrtRunner

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        artifacts = {a["kind"]: Path(tmp) / a["path"] for a in export_compaction_artifacts(Path(tmp), KV_HEADS, 128, "float32", 20)}
        runners = {"ort_std_ops": OnnxrtRunner(artifacts["threshold_compaction"]),
                   "ort_plugin_node": OnnxrtRunner(artifacts["threshold_compaction_plugin"], custom_ops=True)}
        for runner in runners.values():
            runner.activate()
        try:
            for seq in lengths:
                scores, lens = _inputs(seq)
                feed = {"scores": scores.numpy(), "lengths": lens.numpy(), "threshold": np.array(threshold, np.float32),
                        "window": np.array(window, np.int32)}
                results = {"torch_reference": measure(lambda: threshold_compaction(scores, lens, threshold, window))}
                for name, runner in runners.items():
                    results[name] = measure(lambda r=runner: r.infer(feed))
                if device == "cuda":
                    results.update(_gpu_kernels(seq, threshold, window))
                ref = results["torch_reference"]["median_s"]
                for backend, timing in results.items():
                    rows.append({"benchmark": "compaction", "seq": seq, "kv_heads": KV_HEADS, "backend": backend,
                                 "median_s": timing["median_s"], "speedup_vs_torch_reference": ref / timing["median_s"]})
        finally:
            for runner in runners.values():
                runner.deactivate()
    return rows


def _gpu_kernels(seq: int, threshold: float, window: int) -> dict:
    try:
        from kvzap_export.kernels.triton_compaction import triton_threshold_compaction
    except ImportError:
        return {}
    scores, lens = _inputs(seq, "cuda")
    return {"triton_kernel": measure(lambda: triton_threshold_compaction(scores, lens, threshold, window), sync=torch.cuda.synchronize)}
