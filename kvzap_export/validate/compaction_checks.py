"""Operator-level checks of the compaction graphs and kernels: decisions must match the reference exactly.

Independent pairs: the std-ops graph, the plugin node and the K/V-move graph in ONNX Runtime (the plugin node's ORT
kernel is the rule written from its specification in NumPy, ``runners.compaction_spec``, no code shared with the
reference), TensorRT's engines, and the Triton and CUDA kernels each compute the decisions themselves and are
compared with the PyTorch reference.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from kvzap_export.export.dtypes import TORCH_DTYPES
from kvzap_export.runners.onnxrt_runner import OnnxrtRunner
from kvzap_export.runners.torch_ref import TorchRunner
from kvzap_export.validate.checks import Check
from kvzap_export.validate.compare import compare_outputs, exact
from kvzap_export.validate.device import KERNEL_BACKENDS, Device

SHAPES = ((2, 300), (1, 1000), (3, 17))  # (batch, seq); differ from the export sample


def _scores(batch: int, heads: int, seq: int, dtype: str, threshold: float, gen: torch.Generator) -> np.ndarray:
    s = torch.randn(batch, heads, seq, generator=gen) * 2 + threshold
    s[..., ::37] = threshold  # ties with τ: strict < keeps them
    s[..., 5::101] = float("nan")  # NaN is kept
    s[..., 7::103] = float("-inf")
    np_dtype = np.float32 if dtype == "bfloat16" else np.dtype(dtype)
    return s.numpy().astype(np_dtype)


def _feeds(manifest: dict, heads: int, dtype: str) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    tau = float(manifest["pruning"]["threshold"])
    feeds = []
    for batch, seq in SHAPES:
        lengths = torch.randint(1, seq + 1, (batch,), generator=gen).to(torch.int32)
        lengths[0] = seq
        feeds.append({"scores": _scores(batch, heads, seq, dtype, tau, gen), "lengths": lengths.numpy(),
                      "threshold": np.array(tau, dtype=np.float32), "window": np.array(manifest["pruning"]["window"], dtype=np.int32)})
    return feeds


def _reference_compaction(sink: int, dtype: str):
    from kvzap_export.ops import threshold_compaction

    torch_dtype = TORCH_DTYPES[dtype]

    def run(scores, lengths, threshold, window):
        return threshold_compaction(scores.to(torch_dtype), lengths, float(threshold), int(window), sink)

    return run


def _reference_kv(dtype: str):
    from kvzap_export.ops import kv_compaction

    return _kv_move_in(kv_compaction, dtype)


def _kv_move_in(move, dtype: str):
    """``move`` (the reference's or a kernel's K/V move) in the bundle's dtype (bfloat16 feeds travel as float32
    holding bfloat16 values)."""
    torch_dtype = TORCH_DTYPES[dtype]
    return lambda keys, values, indices: move(keys.to(torch_dtype), values.to(torch_dtype), indices)


def _kernel_compaction(kernels, sink: int, dtype: str):
    torch_dtype = TORCH_DTYPES[dtype]

    def run(scores, lengths, threshold, window):
        return kernels.threshold_compaction(scores.to(torch_dtype), lengths, float(threshold), int(window), sink)

    return run


def _kernel_kv(kernels, dtype: str):
    return _kv_move_in(kernels.kv_compaction, dtype)


def _onnxrt_skip_reason(kind: str, dtype: str, backends) -> str | None:
    if "onnxrt" not in backends:
        return "onnxrt backend not requested"
    if kind.endswith("_plugin") and dtype != "float32":
        return "the ONNX Runtime implementation of the plugin node takes float32 scores; TensorRT's plugin takes every dtype"
    if kind.endswith("_plugin") and importlib.util.find_spec("onnxruntime_extensions") is None:
        return "onnxruntime-extensions is not installed (pip install 'kvzap-export[ortx]'); it runs the plugin node in ORT"
    return None


def _backend_runners(bundle: Path, manifest: dict, artifact: dict, backends, plugin_libraries, device: Device
                     ) -> list[tuple[str, object, str | None]]:
    """``(check name, runner or None, reason when None)`` for each requested backend of this artifact."""
    kind, dtype, sink = artifact["kind"], manifest["dtype"], manifest["pruning"]["sink"]
    out = []
    reason = _onnxrt_skip_reason(kind, dtype, backends)
    # ORT CPU has no bfloat16 kernels: bfloat16 graphs run emulated (float32 compute, bf16 rounding).
    runner = None if reason else OnnxrtRunner(bundle / artifact["path"], custom_ops=kind.endswith("_plugin"),
                                              bf16_emulation=dtype == "bfloat16", providers=device.ort_providers, threads=1)
    out.append((f"operator:{kind}", runner, reason))
    if "trt" in backends:
        from kvzap_export.runners.trt import TrtRunner

        engine = TrtRunner.for_artifact(bundle, manifest, artifact["path"], plugin_libraries)
        skipped = next((s["reason"] for s in (manifest.get("engines") or {}).get("skipped", []) if s.get("source") == artifact["path"]),
                       "no TensorRT engine was built from this artifact")
        out.append((f"operator:{kind}:trt", engine, None if engine else skipped))
    # The GPU kernels implement the same contract as the std-ops graph and the K/V move (not the plugin node's
    # ONNX form): each is checked once, beside the artifact it implements.
    if kind in ("threshold_compaction", "kv_compaction"):
        outputs = ["keep", "counts", "indices"] if kind == "threshold_compaction" else ["keys_out", "values_out"]
        for name in (b for b in KERNEL_BACKENDS if b in backends):
            kernels = device.kernels.get(name, f"the {name} kernels were not set up for device {device.kind}")
            if isinstance(kernels, str):
                out.append((f"operator:{kind}:{name}", None, kernels))
                continue
            fn = _kernel_compaction(kernels, sink, dtype) if kind == "threshold_compaction" else _kernel_kv(kernels, dtype)
            out.append((f"operator:{kind}:{name}", KernelRunner(fn, outputs, name, device.torch_device), None))
    return out


class KernelRunner(TorchRunner):
    """A GPU kernel (Triton, CUDA library) behind the runner contract; inputs moved to its device."""

    def __init__(self, fn, output_names: list[str], backend: str, device: str):
        super().__init__(fn, {}, output_names, name=f"{backend}-kernel", device=device)
        self.backend = backend

    def get_input_metadata_impl(self):
        return self.metadata

    def infer(self, feed):
        self.metadata = {k: (str(np.asarray(v).dtype), list(np.asarray(v).shape)) for k, v in feed.items()}
        return super().infer(feed)


def check_compaction_artifacts(bundle: Path, manifest: dict, backends, plugin_libraries: tuple[str, ...] = (),
                               device: Device | None = None) -> list[Check]:
    """Each compaction artifact, on each requested backend (ORT; TensorRT engines with ``trt``; the Triton / CUDA
    kernels with ``triton`` / ``cuda``), vs the reference (on ``device``): exact."""
    device = device or Device("cpu")
    checks = []
    heads = manifest["model"]["num_kv_heads"]
    dtype = manifest["dtype"]
    sink = manifest["pruning"]["sink"]
    for artifact in manifest["artifacts"]:
        kind = artifact["kind"]
        if kind not in ("threshold_compaction", "threshold_compaction_plugin", "kv_compaction"):
            continue
        if kind == "kv_compaction":
            feeds, ref_fn, outputs = _kv_feeds(manifest, heads), _reference_kv(dtype), ["keys_out", "values_out"]
        else:
            feeds, ref_fn, outputs = _feeds(manifest, heads, dtype), _reference_compaction(sink, dtype), ["keep", "counts", "indices"]
        references = None
        for name, runner, reason in _backend_runners(bundle, manifest, artifact, backends, plugin_libraries, device):
            if runner is None:
                checks.append(Check(name, "operator", "skipped", {"reason": reason}))
                continue
            if references is None:
                references = [_run_reference(ref_fn, feed, outputs, device.torch_device) for feed in feeds]
            mismatches, failed = 0, []
            with runner:
                for feed, ref in zip(feeds, references):
                    for result in compare_outputs(ref, runner.infer(feed), exact(), exact()):
                        mismatches += max(result.mismatches, 0)
                        if not result.passed:
                            failed.append(result.output)
            first = next(iter(feeds[0]))
            checks.append(Check(name, "operator", "failed" if failed else "passed",
                                {"artifact": artifact["path"], "shapes": [list(f[first].shape) for f in feeds],
                                 "mismatches": mismatches, "comparison": "exact", "dtype": dtype,
                                 **({"onnxruntime_providers": list(runner.providers_used)}
                                    if getattr(runner, "providers_used", None) else {}),
                                 "backend": runner.backend, "reference_device": device.torch_device,
                                 **({"failed": sorted(set(failed))} if failed else {})}))
    return checks


def _run_reference(ref_fn, feed: dict, outputs: list[str], device: str = "cpu") -> dict:
    with TorchRunner(ref_fn, {k: (str(v.dtype), list(v.shape)) for k, v in feed.items()}, outputs, device=device) as reference:
        return reference.infer(feed)


def _kv_feeds(manifest: dict, heads: int) -> list[dict]:
    from kvzap_export.ops import threshold_compaction

    gen = torch.Generator().manual_seed(2)
    head_dim = manifest["model"]["head_dim"]
    feeds = []
    for batch, seq in SHAPES[:2]:
        scores = torch.randn(batch, heads, seq, generator=gen)
        lengths = torch.full((batch,), seq, dtype=torch.int32)
        indices = threshold_compaction(scores, lengths, 0.0, 16).indices
        keys, values = (_values_in(torch.randn(batch, heads, seq, head_dim, generator=gen), manifest["dtype"]) for _ in range(2))
        feeds.append({"keys": keys, "values": values, "indices": indices.numpy()})
    return feeds


def _values_in(t: torch.Tensor, dtype: str) -> np.ndarray:
    """Values representable in the graph dtype; bfloat16 ones travel as float32 (numpy has no bfloat16)."""
    if dtype == "bfloat16":
        return t.to(torch.bfloat16).float().numpy()
    return t.numpy().astype(np.dtype(dtype))
