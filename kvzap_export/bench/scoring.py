"""Surrogate scoring per layer: ONNX Runtime vs torch eager vs torch.compile, tokens/s."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from kvzap_export.bench.timing import measure_interleaved
from kvzap_export.export.surrogate_onnx import bind_layer, export_template
from kvzap_export.surrogate.model import Surrogate, SurrogateConfig

# Llama-3.1-8B and Qwen3-8B share the surrogate's shapes (hidden 4096, 8 KV heads, MLP hidden 512).
SHAPES = {"llama-3.1-8b/qwen3-8b": (4096, 8, 512)}
TOKENS = (1, 512, 8192)


def _ort_session(surrogate: Surrogate, directory: Path):
    from kvzap_export.runners.onnxrt import ort_session

    model = bind_layer(export_template(surrogate, "float32", 20), surrogate, 0, "float32")
    path = directory / "layer.onnx"
    path.write_bytes(model.SerializeToString())
    return ort_session(path)  # as the toolkit's runners configure it


def bench_scoring(device: str = "cpu", tokens=TOKENS, compile_torch: bool = True) -> list[dict]:
    rows = []
    for shape_name, (hidden, heads, mlp_hidden) in SHAPES.items():
        for variant in ("linear", "mlp"):
            torch.manual_seed(0)
            surrogate = Surrogate(SurrogateConfig(hidden, heads, 1, mlp_hidden if variant == "mlp" else None)).eval().to(device)
            layer = surrogate.layers[0]
            compiled = torch.compile(layer, dynamic=True) if compile_torch else None
            sync = torch.cuda.synchronize if device == "cuda" else None
            with tempfile.TemporaryDirectory() as tmp:
                session = _ort_session(surrogate.cpu(), Path(tmp)) if device == "cpu" else None
                surrogate.to(device)
                for count in tokens:
                    x = torch.randn(count, hidden, device=device)
                    x_np = x.cpu().numpy()
                    fns = {"torch_eager": lambda: layer(x)}
                    if compiled is not None:
                        fns["torch_compile"] = lambda: compiled(x)
                    if session is not None:
                        fns["onnxruntime"] = lambda: session.run(None, {"hidden_states": x_np})
                    with torch.no_grad():
                        results = measure_interleaved(fns, sync=sync)
                    for backend, timing in results.items():
                        rows.append({"benchmark": "scoring", "shapes": shape_name, "variant": variant, "tokens": count,
                                     "backend": backend, "median_s": timing["median_s"],
                                     "tokens_per_s": count / timing["median_s"],
                                     "ratio_vs_eager": timing["ratio_vs_first"]})
    return rows


def flops_per_token(hidden: int, heads: int, mlp_hidden: int | None) -> int:
    """Multiply-adds x 2 of one surrogate layer for one token."""
    if mlp_hidden is None:
        return 2 * hidden * heads
    return 2 * (hidden * mlp_hidden + mlp_hidden * heads)


