"""TensorRT engines for a bundle's ONNX artifacts (TensorRT 10.x / 11.x Python API).

One engine per ONNX artifact, in ``engines/<name>.plan``:

- strongly typed network (``NetworkDefinitionCreationFlag.STRONGLY_TYPED``): the precision comes from the ONNX
  types, as TensorRT 11 requires (it removed the FP16/BF16 builder flags); no precision flag is ever set;
- one optimization profile per engine covering every dynamic input: ``num_tokens`` up to the bundle's
  ``max_tokens``, ``seq`` up to ``max_seq`` (default: ``max_tokens``, capped by the model's context length),
  ``batch`` up to ``max_batch``; opt = min(512, max), batch opt 1;
- a persistent timing cache (default ``engines/timing.cache`` inside the bundle, or ``--timing-cache PATH``);
- optional hardware compatibility (``ampere+``: any Ampere-or-newer GPU; ``same``: any GPU of this compute
  capability) and version compatibility (later TensorRT versions can run the engine; the plugin library is then
  serialized into the plugin engine);
- the plugin-node artifact needs an implementation of the plugin: the C++ library (``plugins/``, ``--plugin-lib``)
  or the Python AOT plugin (``--python-plugin``: ``kernels/trt_plugin.py``, the Triton kernel compiled to PTX
  and carried by the engine, under a namespace of its own); without either that artifact is skipped and the
  reason recorded.

The manifest records each engine as a ``trt_engine`` artifact (``source``, ``inputs``/``outputs`` of the source,
``profile``), ``tools.tensorrt`` and an ``engines`` section (TensorRT version, GPU name and compute capability,
options, skipped artifacts, status). ``build_engines`` rewrites an existing bundle atomically through
``BundleWriter`` (hashes and integrity digests recomputed); the pipeline calls ``build_into`` on the bundle it is
writing.

Status: this module has never run: TensorRT cannot be installed on the machines of this project. Every TensorRT
name it uses is checked against the real TensorRT 11.4 bindings (tests/trt/test_trt_api_names.py).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvzap_export.bundle.manifest import MANIFEST_NAME, read_manifest
from kvzap_export.errors import BundleError, ConfigError, KvzapError, MissingDependencyError
from kvzap_export.trt.availability import BUILD_PLUGIN, gpu_name, import_tensorrt, load_plugin_libraries, tensorrt_status

ENGINE_DIR = "engines"
TIMING_CACHE = f"{ENGINE_DIR}/timing.cache"
HARDWARE_COMPAT = ("none", "ampere+", "same")
PLUGIN_KINDS = ("threshold_compaction_plugin",)
OPT_TOKENS = 512


@dataclass
class BuildOptions:
    """How engines are built; the defaults suit the GPU they are built on."""

    require_trt: bool = False
    plugin_libraries: tuple[str, ...] = ()
    python_plugin: bool = False  # the plugin node through tensorrt.plugin's AOT implementation, not a library
    # The main command's automatic choice: a plugin that cannot be set up or built skips the plugin-node engine
    # (with the reason) instead of failing the build; `kvzap-export build` keeps what the user asked for strict.
    plugin_optional: bool = False
    timing_cache: str | None = None  # default: BUNDLE/engines/timing.cache
    hardware_compat: str = "none"  # none | ampere+ | same
    version_compatible: bool = False
    workspace_gib: float = 4.0
    max_batch: int = 8
    max_seq: int | None = None  # default: max_tokens, capped by the model's max_position_embeddings

    def __post_init__(self) -> None:
        if self.python_plugin and self.plugin_libraries:
            raise ConfigError("--python-plugin and --plugin-lib both implement the plugin node: pass one of them")
        if self.hardware_compat not in HARDWARE_COMPAT:
            raise ConfigError(f"--hardware-compat {self.hardware_compat!r}: use one of {list(HARDWARE_COMPAT)}")
        if not self.workspace_gib > 0:
            raise ConfigError(f"--workspace-gib {self.workspace_gib!r} must be positive")
        for name, value in (("--max-batch", self.max_batch), ("--max-seq", self.max_seq)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} {value!r} must be a positive integer")


def default_max_seq(manifest: dict) -> int:
    """``max_tokens``, capped by the model's context length when the manifest records it."""
    context = manifest.get("config", {}).get("preset", {}).get("max_position_embeddings")
    return min(manifest["max_tokens"], context) if isinstance(context, int) and context > 0 else manifest["max_tokens"]


def profile_shapes(artifact: dict, max_tokens: int, max_batch: int = 8, max_seq: int | None = None
                   ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(min, opt, max) shape of every input with a symbolic dimension; static inputs need none.

    ``batch``: 1 / 1 / max_batch; ``seq``: 1 / min(512, max_seq) / max_seq; any other symbol (``num_tokens``):
    1 / min(512, max_tokens) / max_tokens.
    """
    max_seq = max_seq or max_tokens
    ranges = {"batch": (1, 1, max_batch), "seq": (1, min(OPT_TOKENS, max_seq), max_seq)}
    tokens = (1, min(OPT_TOKENS, max_tokens), max_tokens)
    shapes = {}
    for name, (_dtype, dims) in artifact["inputs"].items():
        if all(isinstance(d, int) for d in dims):
            continue
        triples = [(d, d, d) if isinstance(d, int) else ranges.get(d, tokens) for d in dims]
        shapes[name] = tuple(tuple(t[i] for t in triples) for i in range(3))
    return shapes


def engine_path_for(source: str) -> str:
    return f"{ENGINE_DIR}/{Path(source).with_suffix('.plan').name}"


def _write_atomically(path: Path, data: bytes) -> None:
    """Never writes into an existing file (it may be a hard link into the bundle being replaced)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def network_flags(trt, python_plugin: bool) -> int:
    """Strongly typed (required on 10.x for typed graphs, always on in 11.x); with the Python plugin, its AOT
    implementation (PTX in the engine) explicitly, never a Python callback."""
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    if python_plugin:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS)
    return flags


def _python_plugin_model(onnx_path: Path) -> bytes:
    """The plugin graph with its node pointed at the Python plugin's namespace (``kernels/trt_plugin.py``)."""
    import onnx

    from kvzap_export.kernels.trt_plugin import python_plugin_graph

    return python_plugin_graph(onnx.load(str(onnx_path))).SerializeToString()


def _build_one(trt, logger, onnx_path: Path, label: str, shapes: dict, options: BuildOptions,
               cache_bytes: bytes | None, plugin: bool) -> tuple[bytes, bytes]:
    """One serialized engine and the updated timing cache; ``label`` names the artifact in errors."""
    python_plugin = plugin and options.python_plugin
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt, python_plugin))
    parser = trt.OnnxParser(network, logger)
    if python_plugin:
        parsed = parser.parse(_python_plugin_model(onnx_path))
    else:
        parsed = parser.parse_from_file(str(onnx_path))
    if not parsed:
        errors = [" ".join(str(parser.get_error(i)).split()) for i in range(parser.num_errors)]
        raise BundleError(f"{label}: TensorRT {trt.__version__}'s ONNX parser reported {len(errors)} error(s): "
                          + " | ".join(errors))
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options.workspace_gib * (1 << 30)))
    # TensorRT enables TF32 by default: float32 products on 10-bit mantissas, far outside the float32 bound the
    # validation holds an engine to (validate/error_bounds.py). Float32 graphs are built in float32.
    config.clear_flag(trt.BuilderFlag.TF32)
    if shapes:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    cache = config.create_timing_cache(cache_bytes or b"")
    if cache is None or not config.set_timing_cache(cache, ignore_mismatch=False):
        # A cache from another GPU or TensorRT version (or a damaged file): start a fresh one rather than fail.
        config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)
    if options.hardware_compat == "ampere+":
        config.hardware_compatibility_level = trt.HardwareCompatibilityLevel.AMPERE_PLUS
    elif options.hardware_compat == "same":
        config.hardware_compatibility_level = trt.HardwareCompatibilityLevel.SAME_COMPUTE_CAPABILITY
    if options.version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
        if plugin and options.plugin_libraries:  # the engine carries its plugin library: no --plugin-lib later
            config.plugins_to_serialize = [str(Path(p).expanduser().resolve()) for p in options.plugin_libraries]
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BundleError(f"{label}: TensorRT {trt.__version__} could not build an engine (see the TensorRT log above)")
    return bytes(plan), bytes(config.get_timing_cache().serialize())


def build_into(directory: Path, manifest: dict, options: BuildOptions, on_step: Callable[[], None] | None = None
               ) -> dict[str, Any]:
    """Builds the engines of the bundle in ``directory`` (being written) and records them in ``manifest``.

    Writes ``engines/*.plan`` and the timing cache; leaves hashing to the bundle writer's commit.
    Returns ``{"tensorrt", "gpu", "status", "engines", "skipped"}``.
    """
    trt, why_not = import_tensorrt()
    if trt is None:
        raise MissingDependencyError(why_not)
    import torch

    directory = Path(directory)
    logger = trt.Logger(trt.Logger.WARNING)
    plugin_problem = None
    try:
        load_plugin_libraries(trt, options.plugin_libraries)
        if options.python_plugin:
            from kvzap_export.kernels.trt_plugin import register_plugin

            register_plugin()
    except KvzapError as exc:
        if not options.plugin_optional:
            raise
        plugin_problem = f"the plugin could not be set up: {exc}"
    cache_path = Path(options.timing_cache).expanduser() if options.timing_cache else directory / TIMING_CACHE
    cache_bytes = cache_path.read_bytes() if cache_path.is_file() else None
    max_seq = options.max_seq or default_max_seq(manifest)
    built: list[dict] = []
    skipped: list[dict] = []
    for artifact in [a for a in manifest["artifacts"] if a["kind"] != "trt_engine" and a["path"].endswith(".onnx")]:
        plugin = artifact["kind"] in PLUGIN_KINDS
        if plugin and plugin_problem:
            skipped.append({"source": artifact["path"], "reason": plugin_problem})
        elif plugin and not (options.plugin_libraries or options.python_plugin):
            skipped.append({"source": artifact["path"], "reason": "needs the TensorRT plugin library: pass --plugin-lib "
                            f"build/libkvzap_trt_plugin.so (built by `{BUILD_PLUGIN}`), or --python-plugin"})
        else:
            shapes = profile_shapes(artifact, manifest["max_tokens"], options.max_batch, max_seq)
            try:
                plan, cache_bytes = _build_one(trt, logger, directory / artifact["path"], artifact["path"], shapes,
                                               options, cache_bytes, plugin)
            except KvzapError as exc:
                if not (plugin and options.plugin_optional):
                    raise
                plan = None
                skipped.append({"source": artifact["path"], "reason": f"the plugin-node engine did not build: {exc}"})
            if plan is not None:
                path = engine_path_for(artifact["path"])
                if any(e["path"] == path for e in built):
                    raise BundleError(f"{artifact['path']}: its engine name {path} is taken by another artifact")
                _write_atomically(directory / path, plan)
                built.append({"kind": "trt_engine", "path": path, "source": artifact["path"],
                              "inputs": artifact["inputs"], "outputs": artifact["outputs"],
                              "profile": {name: {"min": list(lo), "opt": list(opt), "max": list(hi)}
                                          for name, (lo, opt, hi) in shapes.items()}})
        if on_step:
            on_step()
    if cache_bytes:
        _write_atomically(cache_path, cache_bytes)
    inside = cache_path.resolve().is_relative_to(directory.resolve())
    version, gpu = trt.__version__, gpu_name()
    major, minor = torch.cuda.get_device_capability(0)
    status = f"built {len(built)} engine(s)" + (f", skipped {len(skipped)}" if skipped else "") + f" (TensorRT {version}, {gpu})"
    manifest["artifacts"] = [a for a in manifest["artifacts"] if a["kind"] != "trt_engine"] + built
    manifest.setdefault("tools", {})["tensorrt"] = version
    manifest["engines"] = {
        "tensorrt": version, "gpu": gpu, "compute_capability": f"{major}.{minor}", "status": status,
        "hardware_compat": options.hardware_compat, "version_compatible": options.version_compatible,
        "workspace_gib": options.workspace_gib, "max_batch": options.max_batch, "max_seq": max_seq,
        "max_tokens": manifest["max_tokens"],
        "timing_cache": cache_path.resolve().relative_to(directory.resolve()).as_posix() if inside else str(cache_path.resolve()),
        "plugin_libraries": [Path(p).name for p in options.plugin_libraries], "skipped": skipped,
        "plugin": "python-aot" if options.python_plugin else ("library" if options.plugin_libraries else None),
    }
    return {"tensorrt": version, "gpu": gpu, "status": status, "engines": built, "skipped": skipped}


def _stage_copy(bundle: Path, staging: Path) -> None:
    """The bundle's files into ``staging``, except the manifest (the commit writes it) and old engine plans.

    Hard links where the filesystem allows: nothing in the staging copy is written in place (engines and the
    timing cache are replaced atomically, the manifest is not linked), so the original stays intact.
    """
    for path in sorted(bundle.rglob("*")):
        relative = path.relative_to(bundle)
        if not path.is_file() or relative.as_posix() == MANIFEST_NAME:
            continue
        if relative.parts[0] == ENGINE_DIR and path.suffix == ".plan":
            continue
        target = staging / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:
            shutil.copy2(path, target)


def build_engines(bundle: str | Path, options: BuildOptions | None = None,
                  on_step: Callable[[], None] | None = None) -> dict[str, Any]:
    """Builds the engines of an existing bundle and rewrites it atomically.

    Without TensorRT or a GPU the bundle is left unchanged and the status says why (``require_trt``: raises
    ``MissingDependencyError`` instead). A bundle that fails ``verify`` is refused: rebuilding would bless it.
    """
    from kvzap_export.bundle.verify import verify_bundle
    from kvzap_export.bundle.writer import BundleWriter

    options = options or BuildOptions()
    bundle = Path(bundle)
    manifest = read_manifest(bundle)
    why_not = tensorrt_status()
    if why_not is not None:
        if options.require_trt:
            raise MissingDependencyError(f"--require-trt: {why_not}")
        return {"tensorrt": None, "gpu": None, "status": f"no engines built: {why_not}; bundle unchanged",
                "engines": [], "skipped": []}
    problems = verify_bundle(bundle)
    if problems:
        raise BundleError(f"{bundle}: the bundle fails verification ({problems[0]}; {len(problems)} problem(s) in all); "
                          f"run `kvzap-export verify {bundle}` and re-export it")
    with BundleWriter(bundle, force=True) as writer:
        _stage_copy(bundle, writer.tmp)
        result = build_into(writer.tmp, manifest, options, on_step)
        manifest["parity"] = parity_after_build(manifest.get("parity") or {}, manifest, bundle)
        writer.commit(manifest)
    return result


def parity_after_build(parity: dict[str, Any], manifest: dict[str, Any], bundle: Path) -> dict[str, Any]:
    """The manifest's verdict once engines were added after validation: they were never compared with the reference,
    so a ``passed`` becomes ``incomplete``, naming each engine and the command that validates them (a ``failed``
    stays failed). A build that made no engine changes nothing."""
    engines = [a["path"] for a in manifest["artifacts"] if a["kind"] == "trt_engine"]
    if not engines:
        return parity
    how = f"run `kvzap-export validate {bundle} --backends torch,onnxrt,trt` (report/parity.md gives the verdict)"
    reason = f"built by `kvzap-export build` after the bundle was validated; {how}"
    not_run = [n for n in parity.get("not_run", []) if not str(n.get("check", "")).startswith("trt_engine:")]
    not_run += [{"check": f"trt_engine:{path}", "level": "operator", "reason": reason} for path in engines]
    verdict = "failed" if parity.get("verdict") == "failed" else "incomplete"
    before = parity.get("before_build", parity.get("summary"))  # a second build does not stack summaries
    summary = f"{len(engines)} TensorRT engine(s) not validated: {how}" + (f"; before the build: {before}" if before else "")
    checks = {name: status for name, status in (parity.get("checks") or {}).items() if not name.endswith(":trt")}
    return {**parity, "verdict": verdict, "passed": False, "not_run": not_run, "summary": summary, "before_build": before,
            "checks": checks}  # the old engines' results no longer describe these engines
