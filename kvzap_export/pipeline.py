"""The whole pipeline as one public function: preset -> surrogate -> ONNX -> checks -> bundle.

The CLI is a thin layer over ``run_pipeline``; Python users call it directly.
"""

from __future__ import annotations

import errno
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvzap_export import __version__
from kvzap_export.bundle import SCHEMA_VERSION, BundleWriter, tool_versions
from kvzap_export.errors import BundleError, ConfigError
from kvzap_export.export.dtypes import canonical_dtype, check_opset
from kvzap_export.presets import VARIANTS, Preset, load_preset

# A progress callback: (stage description, total steps) -> advance(). ``None`` means silent.
Progress = Callable[[str, int], Callable[[], None]]


@dataclass
class ExportOptions:
    """Everything one export needs; defaults come from the model preset when left ``None``."""

    model: str
    out: Path
    variant: str | None = None
    weights: str | None = None
    dtype: str = "float32"
    opset: int = 20
    threshold: float | None = None
    window: int | None = None
    sink: int | None = None
    max_tokens: int = 8192
    force: bool = False
    check: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Resolved:
    preset: Preset
    variant: str
    dtype: str
    opset: int
    threshold: float
    window: int
    sink: int


def resolve(options: ExportOptions) -> Resolved:
    """Validates every option before anything is written."""
    preset = load_preset(options.model)
    variant = options.variant or preset.surrogate.default_variant
    if variant not in VARIANTS:
        raise ConfigError(f"--variant {variant!r} is not supported; use one of {list(VARIANTS)}")
    threshold = preset.pruning.threshold if options.threshold is None else options.threshold
    try:
        threshold = float(threshold)
    except (TypeError, ValueError):
        raise ConfigError(f"--threshold {threshold!r} is not a number; pass a log-score such as -4") from None
    if not math.isfinite(threshold):
        raise ConfigError(f"--threshold {threshold!r} must be a finite number (log-scores are finite); pass e.g. -4")
    window = preset.pruning.window if options.window is None else options.window
    if isinstance(window, bool) or not isinstance(window, int) or not 0 < window <= 1 << 24:
        raise ConfigError(f"--window {window!r} must be an integer in [1, 16777216]; kvpress uses 128")
    sink = preset.pruning.sink if options.sink is None else options.sink
    if isinstance(sink, bool) or not isinstance(sink, int) or not 0 <= sink <= 1 << 24:
        raise ConfigError(f"--sink {sink!r} must be an integer >= 0 (0 = kvpress semantics)")
    if isinstance(options.max_tokens, bool) or not isinstance(options.max_tokens, int) or options.max_tokens < 1:
        raise ConfigError(f"--max-tokens {options.max_tokens!r} must be a positive integer")
    return Resolved(preset, variant, canonical_dtype(options.dtype), check_opset(options.opset), threshold, window, sink)


def _noop_progress(_description: str, _total: int) -> Callable[[], None]:
    return lambda: None


def _manifest(resolved: Resolved, surrogate, weights_dir: Path, options: ExportOptions) -> dict[str, Any]:
    preset = resolved.preset
    return {
        "schema_version": SCHEMA_VERSION,
        "kvzap_export_version": __version__,
        "model": {
            "preset": preset.name,
            "hf_id": preset.hf_id,
            "hidden_size": preset.hidden_size,
            "num_layers": preset.num_layers,
            "num_attention_heads": preset.num_attention_heads,
            "num_kv_heads": preset.num_kv_heads,
            "head_dim": preset.head_dim,
        },
        "surrogate": {
            "variant": resolved.variant,
            "hidden_dim": surrogate.config.hidden_dim,
            "source": str(options.weights or preset.hub_id(resolved.variant) or weights_dir),
            "path": "surrogate",
        },
        "pruning": {"threshold": resolved.threshold, "window": resolved.window, "sink": resolved.sink},
        "dtype": resolved.dtype,
        "opset": resolved.opset,
        "max_tokens": options.max_tokens,
        "artifacts": [],
        "tools": tool_versions(),
        "parity": {},
        "rebuild": {},
        "config": {"preset": preset.to_dict(), "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()}},
    }


def rebuild_commands(manifest: dict) -> dict[str, list[str]]:
    """trtexec / polygraphy lines a user runs on a TensorRT machine, relative to the bundle root."""
    hidden = manifest["model"]["hidden_size"]
    max_tokens = manifest["max_tokens"]
    trtexec, polygraphy = [], []
    for art in manifest["artifacts"]:
        if art["kind"] != "surrogate_layer":
            continue
        shapes = f"hidden_states:1x{hidden}", f"hidden_states:{min(512, max_tokens)}x{hidden}", f"hidden_states:{max_tokens}x{hidden}"
        engine = "engines/" + Path(art["path"]).with_suffix(".plan").name
        trtexec.append(
            f"trtexec --onnx={art['path']} --minShapes={shapes[0]} --optShapes={shapes[1]} --maxShapes={shapes[2]} "
            f"--saveEngine={engine} --timingCacheFile=engines/timing.cache"
        )
        polygraphy.append(
            f"polygraphy run {art['path']} --onnxrt --trt --trt-min-shapes {shapes[0]} --trt-opt-shapes {shapes[1]} "
            f"--trt-max-shapes {shapes[2]} --input-shapes {shapes[1]} --atol 1e-5 --rtol 1e-5 --check-error-stat max"
        )
    notes = [
        "TensorRT 11 networks are always strongly typed (precision comes from the ONNX types); on TensorRT 10 add --stronglyTyped to trtexec.",
        "Or let kvzap-export do it: kvzap-export build . (needs `tensorrt` importable and a GPU).",
    ]
    return {"trtexec": trtexec, "polygraphy": polygraphy, "notes": notes}


def _write_rebuild_script(path: Path, commands: dict[str, list[str]]) -> None:
    lines = ["#!/usr/bin/env bash", "# Build TensorRT engines from this bundle and compare them with ONNX Runtime.",
             "# Run from the bundle directory on a machine with TensorRT and a GPU.", "set -euo pipefail", "mkdir -p engines"]
    lines += [f"# {note}" for note in commands["notes"]]
    lines += commands["trtexec"] + commands["polygraphy"]
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)


def run_pipeline(options: ExportOptions, progress: Progress | None = None) -> dict[str, Any]:
    """Exports a bundle into ``options.out`` atomically; returns its manifest."""
    from kvzap_export.export.surrogate_onnx import export_surrogate
    from kvzap_export.surrogate import load_surrogate, resolve_weights
    from kvzap_export.validate.operator import check_surrogate_layers

    progress = progress or _noop_progress
    resolved = resolve(options)
    weights_dir = resolve_weights(resolved.preset, resolved.variant, options.weights)
    surrogate = load_surrogate(weights_dir, resolved.preset)
    num_layers = surrogate.config.n_modules
    try:
        with BundleWriter(options.out, force=options.force) as writer:
            manifest = _manifest(resolved, surrogate, weights_dir, options)
            surrogate.save(writer.path("surrogate"))
            advance = progress(f"export {num_layers} {resolved.variant} layers → ONNX ({resolved.dtype})", num_layers)
            manifest["artifacts"] += export_surrogate(surrogate, writer.tmp, resolved.dtype, resolved.opset, on_layer=lambda _l: advance())
            if options.check:
                advance = progress("check ONNX Runtime vs PyTorch", num_layers)
                manifest["parity"]["surrogate_onnx_vs_torch"] = check_surrogate_layers(
                    writer.tmp, manifest["artifacts"], surrogate, resolved.dtype, on_layer=lambda _l: advance()
                )
            manifest["rebuild"] = rebuild_commands(manifest)
            _write_rebuild_script(writer.path("rebuild.sh"), manifest["rebuild"])
            writer.commit(manifest)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise BundleError(f"--out {options.out}: no space left on the device while writing the bundle; free space or choose another path (nothing was written)") from None
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise BundleError(f"--out {options.out}: permission denied while writing ({exc.filename}); choose a writable path (nothing was written)") from None
        raise
    return manifest


def summary(manifest: dict[str, Any]) -> dict[str, Any]:
    """The machine-readable summary ``--json`` prints."""
    parity = {name: check.get("status") for name, check in manifest.get("parity", {}).items()}
    return {
        "out": manifest.get("out"),
        "model": manifest["model"]["preset"],
        "variant": manifest["surrogate"]["variant"],
        "dtype": manifest["dtype"],
        "opset": manifest["opset"],
        "pruning": manifest["pruning"],
        "artifacts": len(manifest["artifacts"]),
        "parity": parity,
        "passed": all(status in ("passed", "skipped") for status in parity.values()),
    }
