"""``validate``: operator, decision and model level parity of a bundle against the PyTorch reference.

Every check is collected (none stops the others); the verdict has three states (``checks.verdict``):
passed, failed, or incomplete when something did not run. The report goes to ``BUNDLE/report/``
(parity.json, parity.md, plots, and with the ``polygraphy`` extra Polygraphy-loadable inputs/reference
outputs with the command that replays the check on TensorRT).
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvzap_export.bundle.manifest import read_manifest
from kvzap_export.bundle.verify import verify_bundle
from kvzap_export.errors import ConfigError
from kvzap_export.presets import Preset
from kvzap_export.surrogate import load_surrogate
from kvzap_export.validate.checks import Check, not_run, required_checks, skipped, verdict
from kvzap_export.validate.decision_level import check_decisions
from kvzap_export.validate.device import KERNEL_BACKENDS, Device, resolve_device
from kvzap_export.validate.hidden import hidden_states_for, resolve_model
from kvzap_export.validate.operator_level import check_operators

BACKENDS = ("torch", "onnxrt", "trt", *KERNEL_BACKENDS)
DEFAULT_BACKENDS = {"cpu": ("torch", "onnxrt"), "cuda": ("torch", "onnxrt", *KERNEL_BACKENDS)}
MODEL_CHECK = "model:compacted_vs_kvpress"


def preset_of(manifest: dict) -> Preset:
    m = manifest["model"]
    return Preset(name=m["preset"], hidden_size=m["hidden_size"], num_layers=m["num_layers"], hf_id=m.get("hf_id"),
                  num_attention_heads=m["num_attention_heads"], num_kv_heads=m["num_kv_heads"], head_dim=m["head_dim"])


def parse_backends(text: str | None, device: str = "cpu") -> tuple[str, ...]:
    """``--backends`` (None: the device's default: torch,onnxrt on the CPU, plus the GPU kernels on cuda)."""
    if text is None:
        return DEFAULT_BACKENDS.get(device, DEFAULT_BACKENDS["cpu"])
    names = tuple(b.strip() for b in text.split(",") if b.strip())
    unknown = [b for b in names if b not in BACKENDS]
    if unknown or not names:
        raise ConfigError(f"--backends {text!r}: unknown backend(s) {unknown}; choose from {', '.join(BACKENDS)}")
    return names


def _start(progress, description: str, total: int):
    return progress(description, total) if progress else None


def validate_bundle(bundle: str | Path, backends: tuple[str, ...] | None = None, device: str | Device = "cpu",
                    model: str | None = None, model_level: bool = True, progress=None, display_name: str | None = None,
                    plugin_libraries: tuple[str, ...] = (), require: tuple[str, ...] = (),
                    cuda_library: str | None = None) -> dict[str, Any]:
    """Runs every check and writes ``BUNDLE/report``; returns the report (``verdict``: passed | failed | incomplete).

    ``trt`` in ``backends`` runs every engine ``kvzap-export build`` made (``plugin_libraries``: the compaction
    plugin's library, needed by the plugin-node engine unless it was built version-compatible); ``triton`` /
    ``cuda`` run the GPU kernels (``validate --device cuda``). ``require``: levels that must run (else failed).
    """
    from kvzap_export.threads import SMALL_WORK, torch_threads

    # Small ops everywhere but the LLM's prefills (which ask for more threads themselves): see kvzap_export.threads.
    with torch_threads(SMALL_WORK):
        return _validate(Path(bundle), backends, device, model, model_level, progress, display_name, plugin_libraries,
                         require, cuda_library)


def _validate(bundle: Path, backends, device, model, model_level, progress, display_name, plugin_libraries, require,
              cuda_library) -> dict[str, Any]:
    from kvzap_export.validate.report import write_report

    manifest = read_manifest(bundle)
    if isinstance(device, str):
        device = resolve_device(device, cuda_library)
    backends = tuple(backends) if backends is not None else DEFAULT_BACKENDS[device.kind]
    if "trt" in backends and not any(a["kind"] == "trt_engine" for a in manifest["artifacts"]):
        raise ConfigError(f"--backends trt: {display_name or bundle} has no TensorRT engines; "
                          f"run `kvzap-export build {display_name or bundle}` on a TensorRT machine first")
    checks: list[Check] = []
    # The bundle as written: manifest.json re-read from disk, its section digests recomputed, every file it lists
    # re-hashed, every ONNX graph loaded and checked (what `kvzap-export verify` does).
    problems = verify_bundle(bundle)
    checks.append(Check("bundle:manifest_integrity", "bundle", "failed" if problems else "passed",
                        {"problems": problems, "files_rehashed": len(manifest.get("files", {})),
                         "summary": "manifest.json re-read from disk: section digests, every listed file re-hashed, "
                                    "ONNX graphs checked"}))
    surrogate = load_surrogate(bundle / manifest["surrogate"].get("path", "surrogate"), preset_of(manifest))
    target = resolve_model(manifest, model)
    advance = _start(progress, f"load {target} and capture hidden states" if target else "synthetic hidden states", 1)
    hidden = hidden_states_for(manifest, model)
    if advance:
        advance()
    n_layers = sum(1 for a in manifest["artifacts"] if a["kind"] == "surrogate_layer")
    advance = _start(progress, "operator level: artifacts vs PyTorch", n_layers)
    operator_checks, samples = check_operators(bundle, manifest, surrogate, backends, hidden, plugin_libraries,
                                               on_step=advance, device=device)
    checks += operator_checks
    advance = _start(progress, f"decision level: {len(hidden.texts)} {hidden.source} sequences × {n_layers} layers", n_layers)
    decision, plots = check_decisions(bundle, manifest, surrogate, hidden, backends, device, plugin_libraries, on_step=advance)
    checks.append(decision)
    if model_level:
        checks.append(_model_level(bundle, manifest, model, progress))
    else:
        checks.append(skipped(MODEL_CHECK, "model", "not requested (--no-model-level)"))
    checks += required_checks(checks, tuple(require))
    state = verdict(checks)
    report = {
        "bundle": display_name or str(bundle),
        "verdict": state,
        "passed": state == "passed",
        "failed": [c.name for c in checks if c.status == "failed"],
        "not_run": not_run(checks),
        "required": list(require),
        "backends": list(backends),
        "device": device.describe(),
        "checks": [asdict(c) for c in checks],
    }
    write_report(bundle, manifest, report, samples, plots)
    return report


def _model_level(bundle: Path, manifest: dict, model: str | None, progress) -> Check:
    try:
        from kvzap_export.validate.model_level import run_model_level
    except ModuleNotFoundError as exc:
        return skipped(MODEL_CHECK, "model", f"model-level check unavailable ({exc.name} is not installed: "
                                             "pip install 'kvzap-export[model,reference]')")
    if importlib.util.find_spec("kvpress") is None:
        return skipped(MODEL_CHECK, "model", "kvpress (the reference it compares with) is not installed: "
                                             "pip install 'kvzap-export[reference]'")
    target = resolve_model(manifest, model)
    if target is None:
        return skipped(MODEL_CHECK, "model", "no local model for this preset; pass --model PATH to a HF model directory")
    result = run_model_level(bundle, manifest, model=target, progress=progress)
    status = result.pop("status", "failed")
    return Check(MODEL_CHECK, "model", status, result)
