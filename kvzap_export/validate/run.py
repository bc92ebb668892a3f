"""``validate``: operator, decision and model level parity of a bundle against the PyTorch reference.

Every check is collected (none stops the others); the verdict is the conjunction. The report goes to
``BUNDLE/report/`` (parity.json, parity.md, plots) and Polygraphy-loadable inputs/reference outputs
go to ``BUNDLE/report/polygraphy/`` with the command that replays the check on TensorRT.
"""

from __future__ import annotations

import importlib.util

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvzap_export.bundle.manifest import integrity_problems, read_manifest
from kvzap_export.errors import ConfigError
from kvzap_export.export.dtypes import TORCH_DTYPES
from kvzap_export.presets import Preset
from kvzap_export.runners.base import Runner
from kvzap_export.runners.onnxrt_runner import OnnxrtRunner
from kvzap_export.runners.torch_ref import TorchRunner
from kvzap_export.surrogate import load_surrogate
from kvzap_export.surrogate.model import Surrogate
from kvzap_export.validate.compare import compare_outputs, simple

BACKENDS = ("torch", "onnxrt", "trt")
TOKEN_COUNTS = (1, 7, 40)  # the export sample has 3 tokens
# |backend - torch| <= atol + rtol*|torch| per output, by graph dtype.
FLOAT_TOLERANCE = {"float32": (1e-5, 1e-5), "float16": (4e-3, 4e-3), "bfloat16": (3e-2, 3e-2)}
# A decision flip is "explained" when the reference score lies within this distance of τ
# (a few units in the last place of the dtype at |τ|); otherwise it is a bug.
FLIP_ULPS = 8


def flip_tolerance(dtype: str, threshold: float) -> float:
    eps = torch.finfo(TORCH_DTYPES[dtype]).eps
    return FLIP_ULPS * eps * max(1.0, abs(threshold))


@dataclass
class Check:
    name: str
    level: str
    status: str  # passed | failed | skipped
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status != "failed"


def preset_of(manifest: dict) -> Preset:
    m = manifest["model"]
    return Preset(name=m["preset"], hidden_size=m["hidden_size"], num_layers=m["num_layers"], hf_id=m.get("hf_id"),
                  num_attention_heads=m["num_attention_heads"], num_kv_heads=m["num_kv_heads"], head_dim=m["head_dim"])


def parse_backends(text: str) -> tuple[str, ...]:
    names = tuple(b.strip() for b in text.split(",") if b.strip())
    unknown = [b for b in names if b not in BACKENDS]
    if unknown or not names:
        raise ConfigError(f"--backends {text!r}: unknown backend(s) {unknown}; choose from {', '.join(BACKENDS)}")
    return names


def _surrogate_runners(bundle: Path, manifest: dict, artifact: dict, surrogate: Surrogate, backends,
                       plugin_libraries: tuple[str, ...]) -> list[Runner]:
    """Reference first, then each requested backend that can run this graph here."""
    layer = artifact["layer"]
    dtype = manifest["dtype"]
    np_dtype = "float32" if dtype == "bfloat16" else dtype
    meta = {"hidden_states": (np_dtype, ["num_tokens", surrogate.config.input_dim])}
    torch_dtype = TORCH_DTYPES[dtype]
    runners: list[Runner] = [TorchRunner(lambda hidden_states: surrogate.score(layer, hidden_states.to(torch_dtype)),
                                         meta, ["scores"], name=f"torch:layer{layer}")]
    if "onnxrt" in backends:
        runners.append(OnnxrtRunner(bundle / artifact["path"], bf16_emulation=dtype == "bfloat16"))
    if "trt" in backends:
        from kvzap_export.runners.trt import TrtRunner

        engine = TrtRunner.for_artifact(bundle, manifest, artifact["path"], plugin_libraries)
        if engine is not None:
            runners.append(engine)
    return runners


def _hidden_feeds(hidden: dict[int, torch.Tensor] | None, layer: int, dim: int, dtype: str, seed: int) -> list[dict]:
    np_dtype = np.float32 if dtype == "bfloat16" else np.dtype(dtype)
    gen = torch.Generator().manual_seed(seed + layer)
    feeds = [{"hidden_states": torch.randn(n, dim, generator=gen).numpy().astype(np_dtype)} for n in TOKEN_COUNTS]
    if hidden is not None and layer in hidden:
        feeds.append({"hidden_states": hidden[layer].float().numpy().astype(np_dtype)})
    return feeds


def check_operators(bundle: Path, manifest: dict, surrogate: Surrogate, backends, hidden,
                    plugin_libraries: tuple[str, ...] = (), on_step: Callable[[], None] | None = None
                    ) -> tuple[list[Check], dict]:
    """Every artifact vs the reference; returns checks and the samples used for plots / Polygraphy."""
    dtype = manifest["dtype"]
    atol, rtol = FLOAT_TOLERANCE[dtype]
    checks, samples = [], {}
    for artifact in manifest["artifacts"]:
        if artifact["kind"] != "surrogate_layer":
            continue
        runners = _surrogate_runners(bundle, manifest, artifact, surrogate, backends, plugin_libraries)
        feeds = _hidden_feeds(hidden, artifact["layer"], surrogate.config.input_dim, dtype, seed=0)
        reference, others = runners[0], runners[1:]
        worst: dict[str, Any] = {"max_abs_error": 0.0, "max_rel_error": 0.0, "mismatches": 0}
        failed_outputs, ran, exported = [], [], []
        with reference:
            ref_outputs = [reference.infer(f) for f in feeds]
        for runner in others:
            with runner:
                ran.append(runner.backend)
                for feed, ref in zip(feeds, ref_outputs):
                    got = runner.infer(feed)
                    if len(ran) == 1:
                        exported.append(got)
                    for result in compare_outputs(ref, got, simple(atol, rtol)):
                        worst["max_abs_error"] = max(worst["max_abs_error"], result.max_abs_error)
                        worst["max_rel_error"] = max(worst["max_rel_error"], result.max_rel_error)
                        worst["mismatches"] += max(result.mismatches, 0)
                        if not result.passed:
                            failed_outputs.append(f"{runner.backend}:{result.output}{' ' + result.detail if result.detail else ''}")
        samples[artifact["layer"]] = (feeds, ref_outputs, exported)
        status = "skipped" if not others else ("failed" if failed_outputs else "passed")
        detail = {"artifact": artifact["path"], "backends": ran, "atol": atol, "rtol": rtol, **worst,
                  "token_counts": [len(f["hidden_states"]) for f in feeds]}
        if not others:
            detail["reason"] = "no backend requested besides the reference"
        if failed_outputs:
            detail["failed"] = sorted(set(failed_outputs))
        checks.append(Check(f"operator:surrogate_layer_{artifact['layer']:03d}", "operator", status, detail))
        if on_step:
            on_step()
    checks += _check_compaction_artifacts(bundle, manifest, backends, plugin_libraries)
    return checks, samples


def _check_compaction_artifacts(bundle: Path, manifest: dict, backends, plugin_libraries: tuple[str, ...]) -> list[Check]:
    from kvzap_export.validate.compaction_checks import check_compaction_artifacts

    return check_compaction_artifacts(bundle, manifest, backends, plugin_libraries)


def check_decisions(bundle: Path, manifest: dict, surrogate: Surrogate, hidden: dict[int, torch.Tensor] | None,
                    backends) -> tuple[Check, dict]:
    """Keep masks from the reference scores vs from each backend's scores, on real hidden states."""
    dtype = manifest["dtype"]
    pruning = manifest["pruning"]
    tau, window, sink = pruning["threshold"], pruning["window"], pruning["sink"]
    tol = flip_tolerance(dtype, tau)
    if hidden is None:
        return Check("decision:keep_masks", "decision", "skipped", {"reason": "no model to produce real hidden states (pass --model)"}), {}
    if "onnxrt" not in backends:
        return Check("decision:keep_masks", "decision", "skipped", {"reason": "no exported backend can run these graphs here"}), {}
    from kvzap_export.ops import threshold_compaction

    per_layer, flips, unexplained, total, kept = [], 0, 0, 0, 0
    heatmap = np.zeros((len(hidden), surrogate.config.output_dim))
    for artifact in manifest["artifacts"]:
        if artifact["kind"] != "surrogate_layer" or artifact["layer"] not in hidden:
            continue
        layer = artifact["layer"]
        x = hidden[layer].to(TORCH_DTYPES[dtype])
        with torch.no_grad():
            ref_scores = surrogate.score(layer, x).float()
        with OnnxrtRunner(bundle / artifact["path"], bf16_emulation=dtype == "bfloat16") as runner:
            feed_dtype = np.float32 if dtype == "bfloat16" else np.dtype(dtype)
            got = runner.infer({"hidden_states": x.float().numpy().astype(feed_dtype)})["scores"]
        got_scores = torch.from_numpy(got.astype(np.float32))
        lengths = torch.tensor([x.shape[0]], dtype=torch.int32)
        # Decisions are taken in the graph dtype, as kvpress compares in the model dtype.
        ref_keep = threshold_compaction(ref_scores.to(TORCH_DTYPES[dtype]).T[None], lengths, tau, window, sink).keep[0]
        got_keep = threshold_compaction(got_scores.to(TORCH_DTYPES[dtype]).T[None], lengths, tau, window, sink).keep[0]
        diff = ref_keep != got_keep
        near = (ref_scores.T - tau).abs() <= tol
        layer_flips, layer_unexplained = int(diff.sum()), int((diff & ~near).sum())
        flips += layer_flips
        unexplained += layer_unexplained
        total += diff.numel()
        kept += int(ref_keep.sum())
        heatmap[layer] = 1.0 - ref_keep.float().mean(dim=1).numpy()
        per_layer.append({"layer": layer, "flips": layer_flips, "unexplained": layer_unexplained,
                          "pruned_fraction": float(1.0 - ref_keep.float().mean())})
    status = "passed" if unexplained == 0 else "failed"
    detail = {"threshold": tau, "window": window, "tolerance": tol, "flips": flips, "unexplained_flips": unexplained,
              "dtype": dtype, "backend": "onnxrt-bf16emu" if dtype == "bfloat16" else "onnxrt",
              "decisions": total, "pruned_fraction": 1.0 - kept / max(total, 1), "layers": per_layer}
    return Check("decision:keep_masks", "decision", status, detail), {"heatmap": heatmap}


def validate_bundle(bundle: str | Path, backends: tuple[str, ...] = ("torch", "onnxrt"), device: str = "cpu",
                    model: str | None = None, model_level: bool = True, progress=None,
                    display_name: str | None = None, plugin_libraries: tuple[str, ...] = ()) -> dict[str, Any]:
    """Runs every check and writes ``BUNDLE/report``; returns the report dict (``passed`` is the verdict).

    ``trt`` in ``backends`` runs every engine ``kvzap-export build`` made (``plugin_libraries``: the compaction
    plugin's library, needed by the plugin-node engine unless it was built version-compatible).
    """
    from kvzap_export.validate.hidden import real_hidden_states, resolve_model
    from kvzap_export.validate.report import write_report

    bundle = Path(bundle)
    manifest = read_manifest(bundle)
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: use cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA GPU is visible to torch; use --device cpu")
    if "trt" in backends and not any(a["kind"] == "trt_engine" for a in manifest["artifacts"]):
        raise ConfigError(f"--backends trt: {display_name or bundle} has no TensorRT engines; "
                          f"run `kvzap-export build {display_name or bundle}` on a TensorRT machine first")
    checks: list[Check] = []
    problems = integrity_problems(manifest)
    checks.append(Check("bundle:manifest_integrity", "bundle", "failed" if problems else "passed", {"problems": problems}))
    preset = preset_of(manifest)
    surrogate = load_surrogate(bundle / manifest["surrogate"].get("path", "surrogate"), preset)
    target = resolve_model(manifest, model)
    advance = progress(f"load {target} for real hidden states", 1) if progress and target else None
    hidden = real_hidden_states(manifest, model)
    if advance:
        advance()
    n_layers = sum(1 for a in manifest["artifacts"] if a["kind"] == "surrogate_layer")
    advance = progress("operator level: artifacts vs PyTorch", n_layers) if progress else None
    operator_checks, samples = check_operators(bundle, manifest, surrogate, backends, hidden, plugin_libraries, on_step=advance)
    checks += operator_checks
    decision, plots = check_decisions(bundle, manifest, surrogate, hidden, backends)
    checks.append(decision)
    if model_level:
        checks.append(_model_level(bundle, manifest, model))
    report = {
        "bundle": display_name or str(bundle),
        "backends": list(backends),
        "device": device,
        "passed": all(c.passed for c in checks),
        "failed": [c.name for c in checks if c.status == "failed"],
        "checks": [asdict(c) for c in checks],
    }
    write_report(bundle, manifest, report, samples, plots)
    return report


def _model_level(bundle: Path, manifest: dict, model: str | None) -> Check:
    try:
        from kvzap_export.validate.model_level import run_model_level
    except ModuleNotFoundError as exc:
        return Check("model:compacted_vs_kvpress", "model", "skipped", {"reason": f"model-level check unavailable ({exc.name})"})
    from kvzap_export.validate.hidden import resolve_model

    if importlib.util.find_spec("kvpress") is None:
        return Check("model:compacted_vs_kvpress", "model", "skipped",
                     {"reason": "kvpress (the reference it compares with) is not installed: pip install 'kvzap-export[reference]'"})
    target = resolve_model(manifest, model)
    if target is None:
        return Check("model:compacted_vs_kvpress", "model", "skipped",
                     {"reason": "no local model for this preset; pass --model PATH to a HF model directory"})
    result = run_model_level(bundle, manifest, model=target)
    return Check("model:compacted_vs_kvpress", "model", result.get("status", "failed"), result)
