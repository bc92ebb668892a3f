"""Surrogate scoring per layer: the engines' path (eager functional calls, ``integrations.scoring.BundleScorer``),
the same inside a CUDA graph (GPU), ONNX Runtime (CPU) and, on request, ``torch.compile``; tokens/s.

Which path the engines use, and why: ``BundleScorer`` calls ``F.linear`` / ``F.gelu`` eagerly, with the weights
cast once to the activation dtype. ``torch.compile`` is not used: on an H100 it was slower than eager at every
size measured (0.32-0.91x, 1 to 8,192 tokens, linear and MLP; ../shared/notes/gpu-h100.md), and on a CPU it
gains nothing at decode. At decode one token's scoring is a few microseconds of arithmetic behind three kernel
launches: inside an engine's CUDA graph (SGLang replays its decode forward as a graph) the launches disappear,
which the ``torch_graphed`` row measures. Rows say ``used_by_engines``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from kvzap_export.bench.timing import measure_cuda, measure_interleaved
from kvzap_export.export.surrogate_onnx import bind_layer, export_template
from kvzap_export.surrogate.model import Surrogate, SurrogateConfig

# Llama-3.1-8B and Qwen3-8B share the surrogate's shapes (hidden 4096, 8 KV heads, MLP hidden 512).
SHAPES = {"llama-3.1-8b/qwen3-8b": (4096, 8, 512)}
TOKENS = (1, 512, 8192)
ENGINE_PATHS = {"torch_eager": True, "torch_graphed": True, "onnxruntime": False, "torch_compile": False}


def _ort_session(surrogate: Surrogate, directory: Path):
    from kvzap_export.runners.onnxrt import ort_session

    model = bind_layer(export_template(surrogate, "float32", 20), surrogate, 0, "float32")
    path = directory / "layer.onnx"
    path.write_bytes(model.SerializeToString())
    return ort_session(path)  # as the toolkit's runners configure it


def bench_scoring(device: str = "cpu", tokens=TOKENS, compile_torch: bool = False, dtype=None) -> list[dict]:
    """``dtype``: the activations' (default bfloat16 on a GPU, the model dtype there; float32 on a CPU)."""
    from kvzap_export.bench.overhead import graphed
    from kvzap_export.integrations.scoring import BundleScorer

    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    rows = []
    for shape_name, (hidden, heads, mlp_hidden) in SHAPES.items():
        for variant in ("linear", "mlp"):
            torch.manual_seed(0)
            surrogate = Surrogate(SurrogateConfig(hidden, heads, 1, mlp_hidden if variant == "mlp" else None)).eval()
            scorer = BundleScorer(surrogate)
            compiled = torch.compile(surrogate.layers[0].to(device, dtype), dynamic=True) if compile_torch else None
            with tempfile.TemporaryDirectory() as tmp:
                session = _ort_session(surrogate.cpu(), Path(tmp)) if device == "cpu" else None
                for count in tokens:
                    x = torch.randn(count, hidden, device=device, dtype=dtype)
                    x_np = x.float().cpu().numpy()
                    fns = {"torch_eager": lambda: scorer.score(0, x)}
                    with torch.no_grad():
                        if device == "cuda":
                            fns["torch_graphed"] = graphed(lambda: scorer.score(0, x))
                        if compiled is not None:
                            fns["torch_compile"] = lambda: compiled(x)
                        if session is not None:
                            fns["onnxruntime"] = lambda: session.run(None, {"hidden_states": x_np})
                        results = _timed(fns, device)
                    for backend, timing in results.items():
                        rows.append({"benchmark": "scoring", "shapes": shape_name, "variant": variant, "tokens": count,
                                     "dtype": str(dtype).removeprefix("torch."), "backend": backend,
                                     "used_by_engines": ENGINE_PATHS[backend], "median_s": timing["median_s"],
                                     "tokens_per_s": count / timing["median_s"],
                                     "ratio_vs_eager": timing["ratio_vs_first"]})
                    if device != "cuda":
                        rows.append({"benchmark": "scoring", "shapes": shape_name, "variant": variant, "tokens": count,
                                     "backend": "torch_graphed", "skipped": "CUDA graphs need a CUDA GPU"})
    return rows


def _timed(fns: dict, device: str) -> dict:
    """Interleaved wall-clock rounds on a CPU; CUDA events over back-to-back calls on a GPU (a host sync per call
    would be most of a graph replay's few microseconds)."""
    if device != "cuda":
        return measure_interleaved(fns)
    results = {name: measure_cuda(fn) for name, fn in fns.items()}
    eager = results["torch_eager"]["median_s"]
    return {name: {**r, "ratio_vs_first": eager / r["median_s"]} for name, r in results.items()}


def flops_per_token(hidden: int, heads: int, mlp_hidden: int | None) -> int:
    """Multiply-adds x 2 of one surrogate layer for one token."""
    if mlp_hidden is None:
        return 2 * hidden * heads
    return 2 * (hidden * mlp_hidden + mlp_hidden * heads)


