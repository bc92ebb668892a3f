"""TensorRT engines for a bundle's ONNX artifacts (TensorRT 10.x / 11.x Python API).

One engine per artifact, strongly typed (the ONNX types give the precision; TensorRT 11 removed the
FP16/BF16 builder flags), one optimization profile per dynamic input from the bundle's ``max_tokens``,
a persistent timing cache, optional hardware- and version-compatibility. The plugin-node artifact is
built only with a plugin library (``--plugin-lib``, from ``plugins/``); otherwise it is skipped with
that reason. Engines land in ``engines/`` and the manifest records them (``trt_engine`` artifacts with
their ``source``, ``tools.tensorrt``, ``engines.{tensorrt, gpu}``), with hashes and integrity digests
recomputed and the manifest rewritten durably.

Status: this module has never run — TensorRT cannot be installed on the machines of this project.
Its TensorRT names are checked against the real TensorRT 11.4 bindings (tests/trt/test_trt_api_names.py).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvzap_export.bundle.manifest import (MANIFEST_NAME, read_manifest, section_digests, sha256_file,
                                          write_json_durably)
from kvzap_export.errors import BundleError, MissingDependencyError

ENGINE_DIR = "engines"
TIMING_CACHE = f"{ENGINE_DIR}/timing.cache"
HARDWARE_COMPAT = {"none": "NONE", "ampere+": "AMPERE_PLUS", "same-cc": "SAME_COMPUTE_CAPABILITY"}


@dataclass
class BuildOptions:
    require_trt: bool = False
    plugin_libraries: tuple[str, ...] = ()
    timing_cache: str | None = None  # default: BUNDLE/engines/timing.cache
    hardware_compat: str = "none"
    version_compatible: bool = False
    workspace_gib: float = 4.0


def tensorrt_status() -> str | None:
    """None when engines can be built here; otherwise why not, in one line."""
    if importlib.util.find_spec("tensorrt") is None:
        return "TensorRT is not installed (pip install tensorrt, on a machine with an NVIDIA GPU)"
    import torch

    if not torch.cuda.is_available():
        return "TensorRT is installed but no CUDA GPU is visible"
    return None


def _profile_shapes(artifact: dict, max_tokens: int) -> dict[str, tuple[tuple, tuple, tuple]]:
    """min/opt/max per input: symbolic dims get 1 / min(512, max) / max (batch: 1 / 1 / 8)."""
    shapes = {}
    for name, (_dtype, dims) in artifact["inputs"].items():
        if all(isinstance(d, int) for d in dims):
            continue
        lo, opt, hi = [], [], []
        for d in dims:
            if isinstance(d, int):
                lo.append(d), opt.append(d), hi.append(d)
            elif d == "batch":
                lo.append(1), opt.append(1), hi.append(8)
            else:
                lo.append(1), opt.append(min(512, max_tokens)), hi.append(max_tokens)
        shapes[name] = (tuple(lo), tuple(opt), tuple(hi))
    return shapes


def _build_one(trt, logger, onnx_path: Path, shapes: dict, options: BuildOptions, cache_bytes: bytes | None):
    builder = trt.Builder(logger)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)  # 10.x needs it; 11.x: always typed
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise BundleError(f"{onnx_path.name}: TensorRT's ONNX parser failed: " + " | ".join(errors))
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options.workspace_gib * (1 << 30)))
    if shapes:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    cache = config.create_timing_cache(cache_bytes or b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    if options.hardware_compat != "none":
        config.hardware_compatibility_level = getattr(trt.HardwareCompatibilityLevel, HARDWARE_COMPAT[options.hardware_compat])
    if options.version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BundleError(f"{onnx_path.name}: TensorRT could not build an engine (see the TensorRT log above)")
    return bytes(plan), bytes(config.get_timing_cache().serialize())


def build_engines(bundle: str | Path, options: BuildOptions | None = None, on_step=None) -> dict[str, Any]:
    """Builds every engine it can; returns ``{"tensorrt": version|None, "status": str, "engines": [...]}``."""
    options = options or BuildOptions()
    bundle = Path(bundle)
    why_not = tensorrt_status()
    if why_not is not None:
        if options.require_trt:
            raise MissingDependencyError(f"--require-trt: {why_not}")
        return {"tensorrt": None, "status": f"no engines built: {why_not}", "engines": [], "skipped": []}
    manifest = read_manifest(bundle)
    import tensorrt as trt
    import torch

    logger = trt.Logger(trt.Logger.WARNING)
    registry = trt.get_plugin_registry()
    for library in options.plugin_libraries:
        registry.load_library(str(library))
    cache_path = Path(options.timing_cache) if options.timing_cache else bundle / TIMING_CACHE
    cache_bytes = cache_path.read_bytes() if cache_path.is_file() else None
    (bundle / ENGINE_DIR).mkdir(exist_ok=True)
    built, skipped = [], []
    sources = [a for a in manifest["artifacts"] if a["kind"] != "trt_engine" and a["path"].endswith(".onnx")]
    for artifact in sources:
        if artifact["kind"].endswith("_plugin") and not options.plugin_libraries:
            skipped.append({"source": artifact["path"], "reason": "needs the plugin library: --plugin-lib libkvzap_trt_plugin.so"})
            continue
        plan, cache_bytes = _build_one(trt, logger, bundle / artifact["path"],
                                       _profile_shapes(artifact, manifest["max_tokens"]), options, cache_bytes)
        engine_path = f"{ENGINE_DIR}/{Path(artifact['path']).with_suffix('.plan').name}"
        (bundle / engine_path).write_bytes(plan)
        built.append({"kind": "trt_engine", "path": engine_path, "source": artifact["path"], "sha256": sha256_file(bundle / engine_path)})
        if on_step:
            on_step()
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    if cache_bytes:
        cache_path.write_bytes(cache_bytes)
    gpu = torch.cuda.get_device_name()
    _record(bundle, manifest, built, trt.__version__, gpu, options)
    return {"tensorrt": trt.__version__, "gpu": gpu, "status": f"built {len(built)} engines", "engines": built, "skipped": skipped}


def _record(bundle: Path, manifest: dict, built: list[dict], version: str, gpu: str, options: BuildOptions) -> None:
    """Adds the engines to the manifest, re-hashes and rewrites it durably."""
    manifest["artifacts"] = [a for a in manifest["artifacts"] if a["kind"] != "trt_engine"] + built
    manifest["tools"]["tensorrt"] = version
    manifest["engines"] = {"tensorrt": version, "gpu": gpu, "hardware_compat": options.hardware_compat,
                           "version_compatible": options.version_compatible, "timing_cache": TIMING_CACHE}
    files = {}
    for path in sorted(bundle.rglob("*")):
        relative = path.relative_to(bundle).as_posix()
        if path.is_file() and relative != MANIFEST_NAME and not relative.startswith("report/") and not relative.startswith("."):
            files[relative] = sha256_file(path)
    manifest["files"] = files
    manifest["integrity"] = section_digests(manifest)
    write_json_durably(bundle / MANIFEST_NAME, manifest)
