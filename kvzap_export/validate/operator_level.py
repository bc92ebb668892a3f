"""Operator level: every surrogate graph vs the PyTorch reference, at shapes unlike the export's."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvzap_export.export.dtypes import TORCH_DTYPES
from kvzap_export.runners.base import Runner
from kvzap_export.runners.onnxrt_runner import OnnxrtRunner
from kvzap_export.runners.torch_ref import TorchRunner
from kvzap_export.surrogate.model import Surrogate
from kvzap_export.validate.checks import Check
from kvzap_export.validate.compaction_checks import check_compaction_artifacts
from kvzap_export.validate.compare import compare_outputs, simple
from kvzap_export.validate.device import Device
from kvzap_export.validate.error_bounds import Bounded, reference_and_bound, within
from kvzap_export.validate.hidden import HiddenStates

TOKEN_COUNTS = (1, 7, 40)  # the export sample has 3 tokens


@contextlib.contextmanager
def _exact_float32_matmul():
    """The reference's float32 products in float32 (not TF32) on a GPU, whatever the process set: the bound models
    float32 arithmetic. Restored afterwards."""
    matmul = torch.backends.cuda.matmul
    saved = (matmul.allow_tf32, matmul.allow_fp16_reduced_precision_reduction,
             matmul.allow_bf16_reduced_precision_reduction)
    matmul.allow_tf32 = False
    matmul.allow_fp16_reduced_precision_reduction = False  # split-K partial sums kept in float32
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        (matmul.allow_tf32, matmul.allow_fp16_reduced_precision_reduction,
         matmul.allow_bf16_reduced_precision_reduction) = saved


def _judge(backend: str, got: np.ndarray, bounded: Bounded, used: dict, worst: dict, failed: list) -> None:
    """One computation's scores against the exact ones and their bound; records the share of the bound used."""
    result = within(got, bounded)
    used[backend] = max(used.get(backend, 0.0), result["bound_used"])
    worst["mismatches"] += max(result["mismatches"], 0)
    if not result["passed"]:
        failed.append(f"{backend}:scores {result['mismatches']} scores outside the bound (max abs error "
                      f"{result['max_abs_error']:.3g}, {result['bound_used']:.3g}x the bound)"
                      + (f" {result['detail']}" if result.get("detail") else ""))


def exported_runners(bundle: Path, manifest: dict, artifact: dict, backends, device: Device,
                     plugin_libraries: tuple[str, ...]) -> list[Runner]:
    """The requested backends that can run this surrogate graph here: ONNX Runtime, its TensorRT engine."""
    runners: list[Runner] = []
    if "onnxrt" in backends:
        runners.append(OnnxrtRunner(bundle / artifact["path"], bf16_emulation=manifest["dtype"] == "bfloat16",
                                    providers=device.ort_providers, threads=1))  # small graphs: see kvzap_export.threads
    if "trt" in backends:
        from kvzap_export.runners.trt import TrtRunner

        engine = TrtRunner.for_artifact(bundle, manifest, artifact["path"], plugin_libraries)
        if engine is not None:
            runners.append(engine)
    return runners


def _surrogate_runners(bundle: Path, manifest: dict, artifact: dict, surrogate: Surrogate, backends,
                       plugin_libraries: tuple[str, ...], device: Device) -> list[Runner]:
    """Reference first (on ``device``, in the bundle's dtype), then each requested backend that can run this graph."""
    layer = artifact["layer"]
    dtype = manifest["dtype"]
    np_dtype = "float32" if dtype == "bfloat16" else dtype
    meta = {"hidden_states": (np_dtype, ["num_tokens", surrogate.config.input_dim])}
    torch_dtype = TORCH_DTYPES[dtype]
    reference = TorchRunner(lambda hidden_states: surrogate.score(layer, hidden_states.to(torch_dtype)),
                            meta, ["scores"], name=f"torch:layer{layer}", device=device.torch_device)
    return [reference, *exported_runners(bundle, manifest, artifact, backends, device, plugin_libraries)]


def _hidden_feeds(hidden: HiddenStates | None, layer: int, dim: int, dtype: str, seed: int) -> list[dict]:
    np_dtype = np.float32 if dtype == "bfloat16" else np.dtype(dtype)
    gen = torch.Generator().manual_seed(seed + layer)
    feeds = [{"hidden_states": torch.randn(n, dim, generator=gen).numpy().astype(np_dtype)} for n in TOKEN_COUNTS]
    states = hidden.operator_feed(layer) if hidden is not None else None
    if states is not None:
        feeds.append({"hidden_states": states.float().numpy().astype(np_dtype)})
    return feeds


def check_operators(bundle: Path, manifest: dict, surrogate: Surrogate, backends, hidden: HiddenStates | None,
                    plugin_libraries: tuple[str, ...] = (), on_step: Callable[[], None] | None = None,
                    device: Device | None = None) -> tuple[list[Check], dict]:
    """Every artifact vs the reference; returns checks and the samples used for plots / Polygraphy.

    A surrogate graph's check: the exact scores (float64, from the bundle's kvpress-format copy of the surrogate) and
    a bound per score derived from the computation in the bundle's dtype (``error_bounds``); the PyTorch reference on
    ``device`` and every backend must each stay within it. Two correct computations summing in different orders
    (a GPU and a CPU) both do; an edited weight or a swapped layer does not. The report also gives each backend's
    difference from the PyTorch reference."""
    device = device or Device("cpu")
    surrogate = surrogate.to(device.torch_device)
    dtype = manifest["dtype"]
    checks, samples = [], {}
    for artifact in manifest["artifacts"]:
        if artifact["kind"] != "surrogate_layer":
            continue
        layer = artifact["layer"]
        runners = _surrogate_runners(bundle, manifest, artifact, surrogate, backends, plugin_libraries, device)
        feeds = _hidden_feeds(hidden, layer, surrogate.config.input_dim, dtype, seed=0)
        reference, others = runners[0], runners[1:]
        exact = [reference_and_bound(surrogate.layers[layer], f["hidden_states"], dtype) for f in feeds]
        worst: dict[str, Any] = {"max_abs_error": 0.0, "max_rel_error": 0.0, "mismatches": 0}
        used: dict[str, float] = {}
        failed_outputs, ran, exported, providers = [], [], [], {}
        with _exact_float32_matmul(), reference:
            ref_outputs = [reference.infer(f) for f in feeds]
        for ref, bounded in zip(ref_outputs, exact):
            _judge(reference.backend, ref["scores"], bounded, used, worst, failed_outputs)
        for runner in others:
            with runner:
                ran.append(runner.backend)
                if getattr(runner, "providers_used", None):
                    providers[runner.backend] = list(runner.providers_used)  # read from the session: what ran
                for feed, ref, bounded in zip(feeds, ref_outputs, exact):
                    got = runner.infer(feed)
                    if len(ran) == 1:
                        exported.append(got)
                    _judge(runner.backend, got["scores"], bounded, used, worst, failed_outputs)
                    for result in compare_outputs(ref, got, simple(np.inf, np.inf)):  # the difference, reported
                        worst["max_abs_error"] = max(worst["max_abs_error"], result.max_abs_error)
                        worst["max_rel_error"] = max(worst["max_rel_error"], result.max_rel_error)
        bound = max(exact, key=lambda b: float(b.bound.max(initial=0.0))).describe()
        samples[layer] = (feeds, ref_outputs, exported, bound["bound_max"])
        # the reference outside the bound fails the check even when no backend ran beside it
        status = "failed" if failed_outputs else ("skipped" if not others else "passed")
        detail = {"artifact": artifact["path"], "backends": ran, "bound": bound,
                  "bound_used": {k: round(v, 4) for k, v in used.items()}, **worst,
                  "token_counts": [len(f["hidden_states"]) for f in feeds], "reference_device": device.torch_device,
                  "hidden_states": hidden.source if hidden is not None and len(feeds) > len(TOKEN_COUNTS) else "random only"}
        if providers:
            detail["onnxruntime_providers"] = providers
        if not others:
            detail["reason"] = "no backend requested besides the reference"
        if failed_outputs:
            detail["failed"] = sorted(set(failed_outputs))
        checks.append(Check(f"operator:surrogate_layer_{layer:03d}", "operator", status, detail))
        if on_step:
            on_step()
    checks += check_compaction_artifacts(bundle, manifest, backends, plugin_libraries, device)
    return checks, samples
