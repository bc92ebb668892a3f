"""``verify``: is this bundle exactly what its manifest says? Every problem is collected, not just the first."""

from __future__ import annotations

import os
from pathlib import Path

from kvzap_export.bundle.manifest import integrity_problems, read_manifest, sha256_file
from kvzap_export.errors import KvzapError
from kvzap_export.export.dtypes import graph_io


def _check_onnx(bundle: Path, artifact: dict, problems: list[str]) -> None:
    import onnx

    path = bundle / artifact["path"]
    try:
        model = onnx.load(str(path))
        onnx.checker.check_model(model)
    except Exception as exc:  # onnx raises several unrelated types for a corrupt file
        problems.append(f"{artifact['path']}: not a valid ONNX model ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})")
        return
    inputs, outputs = graph_io(model)
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


def _check_engine_sources(manifest: dict, problems: list[str]) -> None:
    """Every engine names the artifact it was built from (whether it fits this machine: ``trt.compatibility``)."""
    sources = {a["path"] for a in manifest.get("artifacts", []) if a.get("kind") != "trt_engine"}
    for engine in (a for a in manifest.get("artifacts", []) if a.get("kind") == "trt_engine"):
        if engine.get("source") not in sources:
            problems.append(f"{engine['path']}: built from {engine.get('source')!r}, which is not an artifact of this bundle")


def verify_bundle(bundle: str | os.PathLike) -> list[str]:
    """Returns every problem found (empty list: the bundle is intact and consistent).

    Needs no TensorRT: whether the bundle's engines fit this machine's TensorRT and GPU is
    ``kvzap_export.trt.compatibility.engine_compatibility`` (``kvzap-export verify`` runs both).
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
    _check_engine_sources(manifest, problems)
    return problems
