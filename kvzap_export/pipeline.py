"""The whole pipeline as one public function: preset -> surrogate -> ONNX -> checks -> bundle.

The CLI is a thin layer over ``run_pipeline``; Python users call it directly.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvzap_export import __version__
from kvzap_export.bundle import SCHEMA_VERSION, BundleWriter, sha256_file, tool_versions
from kvzap_export.errors import BundleError, ConfigError, KvzapError, MissingDependencyError, ValidationFailedError
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
    require_trt: bool = False  # fail unless TensorRT and a GPU can build the engines
    validate_model: str | None = None  # model of the validation stage (default: the preset's shipped one)
    model_level: bool = True  # run the model-level check in the validation stage
    require: tuple[str, ...] = ()  # validation levels that must run (else the validation fails)


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


def checkpoint_variant(config, asked: str | None, where: Path) -> str:
    """The variant is the checkpoint's (a Linear when its config has no hidden_dim, else an MLP); a ``--variant``
    that contradicts it is a one-line error before anything is written."""
    actual = config.variant
    if asked is not None and asked != actual:
        size = "no hidden_dim" if config.hidden_dim is None else f"hidden_dim {config.hidden_dim}"
        raise ConfigError(f"--variant {asked}: the checkpoint {where} is a {actual} surrogate ({size} in its "
                          f"config.json); pass --variant {actual} or leave --variant out")
    return actual


def _stops_on_interrupt(progress: Progress) -> Progress:
    """Every step of every stage first re-raises an interrupt a library may have caught (``interrupts.check``)."""
    from kvzap_export import interrupts

    def start(description: str, total: int) -> Callable[[], None]:
        interrupts.check()
        advance = progress(description, total)

        def step(*args, **kwargs):
            interrupts.check()
            return advance(*args, **kwargs)

        return step

    return start


def _noop_progress(_description: str, _total: int) -> Callable[[], None]:
    return lambda: None


def _manifest(resolved: Resolved, surrogate, options: ExportOptions) -> dict[str, Any]:
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
            "source": _weights_source(options, resolved),
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
        "config": {"preset": {**preset.to_dict(), "source": portable_source(preset.source)}, "options": _portable_options(options)},
    }


def portable_source(path: str | Path | None) -> str | None:
    """A file or directory the bundle was made from, named without the builder's file system: ``shipped:<path
    inside the package>`` for the toolkit's own files, else ``local:<name>`` (a preset name or hub id stays as is)."""
    if not path:
        return None
    from kvzap_export.presets import CONFIG_DIR, list_presets

    text = str(path)
    if text in list_presets() or not (os.sep in text or text.endswith((".yaml", ".yml", ".json")) or Path(text).exists()):
        return text  # a preset name or a hub id
    resolved = Path(text).expanduser().resolve()
    package = CONFIG_DIR.resolve().parent
    if resolved.is_relative_to(package):
        return f"shipped:{resolved.relative_to(package).as_posix()}"
    name = f"{resolved.parent.name}/{resolved.name}" if resolved.name == "config.json" else resolved.name
    return f"local:{name}"


def _weights_source(options: ExportOptions, resolved: Resolved) -> str:
    if options.weights:
        return portable_source(options.weights)
    if resolved.preset.surrogate.builtin.get(resolved.variant):
        return f"shipped:{resolved.preset.name}/{resolved.variant}"
    return resolved.preset.hub_id(resolved.variant) or "unknown"


def _portable_options(options: ExportOptions) -> dict[str, Any]:
    """The options as given, minus the output path, with paths made portable (``portable_source``)."""
    values = asdict(options)
    values.pop("out")
    for key in ("model", "weights", "validate_model"):
        values[key] = portable_source(values[key])
    values["require"] = list(values["require"])
    return values


def replay_tolerance(surrogate, layer: int, dtype: str, tokens: int) -> float:
    """``--atol`` of a Polygraphy comparison of two correct engines of this layer (e.g. ONNX Runtime and TensorRT) on
    Polygraphy's default inputs (uniform in [0, 1)): each is within the bound of ``validate.error_bounds`` of the
    exact scores, so they differ by at most twice its largest value (computed on such inputs, seeded)."""
    import numpy as np

    from kvzap_export.validate.error_bounds import reference_and_bound

    x = np.random.default_rng(layer).random((tokens, surrogate.config.input_dim), dtype=np.float32)
    return 2.0 * float(reference_and_bound(surrogate.layers[layer], x, dtype).bound.max())


def rebuild_commands(manifest: dict, surrogate=None) -> dict[str, list[str]]:
    """trtexec / polygraphy lines a user runs on a TensorRT machine, relative to the bundle root. With the
    ``surrogate``, each Polygraphy line's tolerance is derived from its layer's computation (``replay_tolerance``);
    without it, 1e-5."""
    hidden = manifest["model"]["hidden_size"]
    max_tokens = manifest["max_tokens"]
    trtexec, polygraphy = [], []
    for art in manifest["artifacts"]:
        if art["kind"] != "surrogate_layer":
            continue
        shapes = f"hidden_states:1x{hidden}", f"hidden_states:{min(512, max_tokens)}x{hidden}", f"hidden_states:{max_tokens}x{hidden}"
        engine = "engines/" + Path(art["path"]).with_suffix(".plan").name
        no_tf32 = " --noTF32" if manifest["dtype"] == "float32" else ""  # TensorRT's default TF32 breaks the float32 bound
        trtexec.append(
            f"trtexec --onnx={art['path']} --minShapes={shapes[0]} --optShapes={shapes[1]} --maxShapes={shapes[2]} "
            f"--saveEngine={engine} --timingCacheFile=engines/timing.cache{no_tf32}"
        )
        atol = (f"{replay_tolerance(surrogate, art['layer'], manifest['dtype'], min(512, max_tokens)):.2g} --rtol 0"
                if surrogate is not None else "1e-5 --rtol 1e-5")
        polygraphy.append(
            f"polygraphy run {art['path']} --onnxrt --trt --trt-min-shapes {shapes[0]} --trt-opt-shapes {shapes[1]} "
            f"--trt-max-shapes {shapes[2]} --input-shapes {shapes[1]} --atol {atol} --check-error-stat max"
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
    from kvzap_export.export.compaction_onnx import export_compaction_artifacts
    from kvzap_export.export.surrogate_onnx import export_surrogate
    from kvzap_export.surrogate import load_surrogate, resolve_weights

    progress = _stops_on_interrupt(progress or _noop_progress)
    resolved = resolve(options)
    if options.require_trt:  # fail before the export's work, not after it
        from kvzap_export.trt.availability import tensorrt_status

        if (why_not := tensorrt_status()) is not None:
            raise MissingDependencyError(f"--require-trt: {why_not}")
    weights_dir = resolve_weights(resolved.preset, resolved.variant, options.weights)
    surrogate = load_surrogate(weights_dir, resolved.preset)
    resolved.variant = checkpoint_variant(surrogate.config, options.variant, weights_dir)
    num_layers = surrogate.config.n_modules
    try:
        with BundleWriter(options.out, force=options.force) as writer:
            manifest = _manifest(resolved, surrogate, options)
            surrogate.save(writer.path("surrogate"))
            manifest["surrogate"]["sha256"] = sha256_file(writer.path("surrogate") / "model.safetensors")
            advance = progress(f"export {num_layers} {resolved.variant} layers → ONNX ({resolved.dtype})", num_layers)
            manifest["artifacts"] += export_surrogate(surrogate, writer.tmp, resolved.dtype, resolved.opset, on_layer=lambda _l: advance())
            preset = resolved.preset
            manifest["artifacts"] += export_compaction_artifacts(
                writer.tmp, preset.num_kv_heads, preset.head_dim, resolved.dtype, resolved.opset, resolved.sink
            )
            manifest["rebuild"] = rebuild_commands(manifest, surrogate)
            _write_rebuild_script(writer.path("rebuild.sh"), manifest["rebuild"])
            manifest = _build_stage(writer, manifest, options, progress)
            if options.check:
                manifest["parity"] = _validate_stage(writer, manifest, options, progress)
                if manifest["parity"]["verdict"] == "failed":
                    # A bundle that fails parity is never shipped; the existing one (if any) stays.
                    raise ValidationFailedError(
                        f"validation failed ({', '.join(manifest['parity']['failed'])}); nothing was written. "
                        f"Re-run with --no-validate, then `kvzap-export validate {options.out}` to read the report"
                    )
            else:
                manifest["parity"] = {"verdict": "incomplete", "passed": False, "summary": "not validated (--no-validate); "
                                      f"run `kvzap-export validate {options.out}`",
                                      "not_run": [{"check": "validation", "level": "all", "reason": "--no-validate"}]}
            writer.commit(manifest)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise BundleError(f"--out {options.out}: no space left on the device while writing the bundle; free space or choose another path (nothing was written)") from None
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise BundleError(f"--out {options.out}: permission denied while writing ({exc.filename}); choose a writable path (nothing was written)") from None
        raise
    return manifest


def _build_stage(writer: BundleWriter, manifest: dict, options: ExportOptions, progress) -> dict[str, Any]:
    """TensorRT engines for the bundle under construction (the last stage but validation).

    Without TensorRT or a GPU: a one-line status and ``engines.tensorrt: null``, unless ``--require-trt``.
    """
    from kvzap_export.trt.availability import tensorrt_status
    from kvzap_export.trt.builder import BuildOptions, build_into

    why_not = tensorrt_status()
    if why_not is not None:
        if options.require_trt:
            raise MissingDependencyError(f"--require-trt: {why_not}")
        manifest["engines"] = {"tensorrt": None, "status": f"no engines built: {why_not}"}
        return manifest
    sources = sum(1 for a in manifest["artifacts"] if a["path"].endswith(".onnx"))
    try:
        build_into(writer.tmp, manifest, BuildOptions(require_trt=options.require_trt, plugin_optional=True,
                                                      **plugin_choice()),
                   on_step=progress("build TensorRT engines", sources))
    except KvzapError as exc:  # the ONNX bundle still ships; the status says what failed
        if options.require_trt:
            raise
        shutil.rmtree(writer.tmp / "engines", ignore_errors=True)
        manifest["engines"] = {"tensorrt": None, "status": f"engine build failed: {exc}"}
    return manifest


def plugin_choice() -> dict[str, Any]:
    """How the build stage implements the plugin node, so that its engine exists for the validation to check: the
    library named by $KVZAP_TRT_PLUGIN_LIB, else the Python AOT plugin where TensorRT and Triton support it, else
    none (that engine is then skipped with the reason, and the verdict is incomplete)."""
    libraries = tuple(p for p in os.environ.get("KVZAP_TRT_PLUGIN_LIB", "").split(os.pathsep) if p)  # as click reads it
    if libraries:
        return {"plugin_libraries": libraries}
    from kvzap_export.kernels.trt_plugin import python_plugin_status

    return {"python_plugin": True} if python_plugin_status() is None else {}


def _validate_stage(writer: BundleWriter, manifest: dict, options: ExportOptions, progress) -> dict[str, Any]:
    """Runs ``validate`` on the bundle under construction; the manifest records the verdict and its summary."""
    from kvzap_export.bundle.manifest import section_digests, write_json_durably
    from kvzap_export.validate.run import validate_bundle

    writer.hash_artifacts(manifest)  # every file's digest, so that validate checks the files as written
    manifest["integrity"] = section_digests(manifest)
    write_json_durably(writer.tmp / "manifest.json", manifest)  # validate reads the bundle as a user would
    # Engines built by the previous stage are validated too (the plugin-node engine with plugin_choice's plugin).
    built = any(a["kind"] == "trt_engine" for a in manifest["artifacts"])
    report = validate_bundle(writer.tmp, ("torch", "onnxrt", "trt") if built else ("torch", "onnxrt"),
                             model=options.validate_model, model_level=options.model_level, progress=progress,
                             display_name=str(options.out), require=options.require,
                             plugin_libraries=plugin_choice().get("plugin_libraries", ()) if built else ())
    return {
        "verdict": report["verdict"],
        "passed": report["verdict"] == "passed",
        "summary": _parity_summary(report),
        "failed": report["failed"],
        "not_run": report["not_run"],
        "checks": {c["name"]: c["status"] for c in report["checks"] if not c["name"].startswith("operator:surrogate_layer_")},
        "surrogate_layers": _layer_summary(report),
        "report": "report/parity.md",
    }


def _parity_summary(report: dict) -> str:
    ran = [c for c in report["checks"] if c["status"] != "skipped"]
    line = f"{report['verdict']}: {sum(c['status'] == 'passed' for c in ran)} of {len(report['checks'])} checks passed"
    if report["failed"]:
        line += f", failed: {', '.join(report['failed'])}"
    if report["not_run"]:
        line += f"; did not run: {', '.join(n['check'] for n in report['not_run'])}"
    return line


def _layer_summary(report: dict) -> dict[str, Any]:
    layers = [c for c in report["checks"] if c["name"].startswith("operator:surrogate_layer_")]
    statuses = {c["status"] for c in layers}
    return {
        "status": "failed" if "failed" in statuses else ("skipped" if "skipped" in statuses or not statuses else "passed"),
        "count": len(layers),
        "max_abs_error": max((c["detail"].get("max_abs_error", 0.0) for c in layers), default=0.0),
        "failed": [c["name"] for c in layers if c["status"] == "failed"],
    }


def summary(manifest: dict[str, Any]) -> dict[str, Any]:
    """The machine-readable summary ``--json`` prints."""
    parity = dict(manifest.get("parity", {}).get("checks", {}))
    if "surrogate_layers" in manifest.get("parity", {}):
        parity["operator:surrogate_layers"] = manifest["parity"]["surrogate_layers"]["status"]
    return {
        "out": manifest.get("out"),
        "model": manifest["model"]["preset"],
        "variant": manifest["surrogate"]["variant"],
        "dtype": manifest["dtype"],
        "opset": manifest["opset"],
        "pruning": manifest["pruning"],
        "artifacts": len(manifest["artifacts"]),
        "tensorrt": manifest.get("engines", {}).get("tensorrt"),
        "engines": manifest.get("engines", {}).get("status"),
        "parity": parity,
        "verdict": manifest.get("parity", {}).get("verdict", "incomplete"),
        "passed": manifest.get("parity", {}).get("verdict") == "passed",
        "not_run": manifest.get("parity", {}).get("not_run", []),
    }
