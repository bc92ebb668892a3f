"""``verify``: is this bundle exactly what its manifest says? Every problem is collected, not just the first."""

from __future__ import annotations

import os
from pathlib import Path

from kvzap_export.bundle.manifest import integrity_problems, read_manifest, sha256_file
from kvzap_export.errors import KvzapError

_ONNX_TYPES = {1: "float32", 10: "float16", 16: "bfloat16", 6: "int32", 7: "int64", 9: "bool"}


def _io_of(model) -> tuple[dict, dict]:
    def spec(values):
        out = {}
        for v in values:
            t = v.type.tensor_type
            out[v.name] = [_ONNX_TYPES.get(t.elem_type, str(t.elem_type)), [d.dim_param or d.dim_value for d in t.shape.dim]]
        return out

    return spec(model.graph.input), spec(model.graph.output)


def _check_onnx(bundle: Path, artifact: dict, problems: list[str]) -> None:
    import onnx

    path = bundle / artifact["path"]
    try:
        model = onnx.load(str(path))
        onnx.checker.check_model(model)
    except Exception as exc:  # onnx raises several unrelated types for a corrupt file
        problems.append(f"{artifact['path']}: not a valid ONNX model ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})")
        return
    inputs, outputs = _io_of(model)
    for kind, declared, actual in (("inputs", artifact.get("inputs", {}), inputs), ("outputs", artifact.get("outputs", {}), outputs)):
        if list(declared) != list(actual):
            problems.append(f"{artifact['path']}: {kind} {list(actual)} but the manifest declares {list(declared)}")
            continue
        for name, (dtype, shape) in declared.items():
            got_dtype, got_shape = actual[name]
            if got_dtype != dtype or [str(d) for d in got_shape] != [str(d) for d in shape]:
                problems.append(f"{artifact['path']}: {name} is {got_dtype}{got_shape}, the manifest declares {dtype}{shape}")
    layer = artifact.get("layer")
    meta = {p.key: p.value for p in model.metadata_props}
    if layer is not None and "kvzap.layer" in meta and meta["kvzap.layer"] != str(layer):
        problems.append(f"{artifact['path']}: graph is layer {meta['kvzap.layer']}, the manifest says layer {layer}")


def _check_surrogate(bundle: Path, manifest: dict, problems: list[str]) -> None:
    from kvzap_export.surrogate.loader import check_against_preset, read_config
    from kvzap_export.presets import Preset

    model = manifest["model"]
    try:
        preset = Preset(name=model["preset"], hidden_size=model["hidden_size"], num_layers=model["num_layers"],
                        num_attention_heads=model["num_attention_heads"], num_kv_heads=model["num_kv_heads"], head_dim=model["head_dim"])
        cfg = read_config(bundle / manifest["surrogate"].get("path", "surrogate"))
        check_against_preset(cfg, preset, bundle / "surrogate")
    except KvzapError as exc:
        problems.append(f"surrogate: {exc}")
        return
    if cfg.variant != manifest["surrogate"]["variant"]:
        problems.append(f"surrogate: checkpoint is {cfg.variant}, the manifest says {manifest['surrogate']['variant']}")


def _check_engines(manifest: dict, problems: list[str], notes: list[str]) -> None:
    """Engines are tied to a TensorRT version and a GPU: check both where TensorRT (and a GPU) can tell."""
    from kvzap_export.trt.availability import gpu_name, import_tensorrt

    engines = [a for a in manifest.get("artifacts", []) if a.get("kind") == "trt_engine"]
    if not engines:
        return
    sources = {a["path"] for a in manifest.get("artifacts", []) if a.get("kind") != "trt_engine"}
    for engine in engines:
        if engine.get("source") not in sources:
            problems.append(f"{engine['path']}: built from {engine.get('source')!r}, which is not an artifact of this bundle")
    built = manifest.get("engines") or {}
    recorded = built.get("tensorrt") or manifest.get("tools", {}).get("tensorrt")
    trt, why_not = import_tensorrt()
    if trt is None:
        notes.append(f"{len(engines)} TensorRT engine(s) not checked against this machine: {why_not}")
        return
    if recorded and trt.__version__ != recorded:
        message = f"engines were built with TensorRT {recorded}, this machine has {trt.__version__}"
        if built.get("version_compatible"):
            notes.append(f"{message} (version-compatible engines: a later TensorRT can run them)")
        else:
            problems.append(f"{message}; rebuild with `kvzap-export build`")
    gpu, here = built.get("gpu"), gpu_name()
    if gpu and here is None:
        notes.append(f"engines were built for GPU {gpu!r}; no CUDA GPU is visible here, so the GPU was not checked")
    elif gpu and here != gpu:
        message = f"engines were built for GPU {gpu!r}, this machine has {here!r}"
        if built.get("hardware_compat") in ("ampere+", "same"):
            notes.append(f"{message} (built with hardware compatibility {built['hardware_compat']!r})")
        else:
            problems.append(f"{message}; rebuild with `kvzap-export build`")


def verify_bundle(bundle: str | os.PathLike, *, check_engines: bool = True, notes: list[str] | None = None) -> list[str]:
    """Returns every problem found (empty list: the bundle is intact and consistent).

    ``check_engines``: also require TensorRT engines to match this machine's TensorRT version and GPU, where
    TensorRT is importable; what could not be checked is appended to ``notes`` when given.
    """
    bundle = Path(bundle)
    manifest = read_manifest(bundle)  # raises BundleError for unreadable / wrong schema
    problems: list[str] = integrity_problems(manifest)
    files = manifest.get("files", {})
    for relative, digest in files.items():
        path = bundle / relative
        if not path.is_file():
            problems.append(f"{relative}: missing")
        elif sha256_file(path) != digest:
            problems.append(f"{relative}: sha256 mismatch (file changed after export)")
    present = {p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()}
    for relative in sorted(present - set(files) - {"manifest.json"}):
        if not relative.startswith(("report/", "engines/")):
            problems.append(f"{relative}: not listed in the manifest")
    for artifact in manifest.get("artifacts", []):
        if not (bundle / artifact["path"]).is_file():
            if artifact["path"] not in files:
                problems.append(f"{artifact['path']}: missing")
            continue
        if files.get(artifact["path"]) != artifact.get("sha256"):
            problems.append(f"{artifact['path']}: artifact sha256 disagrees with the file list")
        if artifact["path"].endswith(".onnx"):
            _check_onnx(bundle, artifact, problems)
    layers = sorted(a["layer"] for a in manifest.get("artifacts", []) if a.get("kind") == "surrogate_layer")
    if layers != list(range(manifest["model"]["num_layers"])):
        problems.append(f"surrogate layers {layers[:5]}... do not cover the model's {manifest['model']['num_layers']} layers")
    _check_surrogate(bundle, manifest, problems)
    if check_engines:
        _check_engines(manifest, problems, notes if notes is not None else [])
    return problems
