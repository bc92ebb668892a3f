"""Imports SGLang 0.5.23's CUDA-path modules on a CPU machine as the GPU bundle would meet them, and reports.

Run with the Python of an environment that has SGLang 0.5.23 (``$KVZAP_SGLANG_PYTHON``, scripts/sglang_cpu_env.sh):

    python scripts/sglang_gpu/emulate_gpu_imports.py [--manifest .gpu/engine/manifest.json] [--dispatch]
        [--jit-paths] [MODULE ...]

What it emulates, before anything of SGLang is imported:
- a CUDA machine: ``torch.cuda.is_available()`` answers True, ``torch.version.cuda`` is "13.0" and the device is an
  sm90 (H200-like), so every ``if is_cuda():`` branch is taken at import. No kernel runs: tensors stay on the CPU;
- the GPU image's package set: installed distributions that are neither in ``gpu_image_packages.txt``, nor carried
  by the bundle (the wheels of ``--manifest``; without one, SGLang's requirement closure over what is installed
  here, judged as the builder judges), nor kvzap-export or SGLang, are hidden from imports and from
  ``importlib.metadata`` (as if not installed);
- modules of image packages that this environment lacks (``IMAGE_ONLY``): placeholders;
- the bundle's start-up: the CUDA stand-in ``sgl_kernel`` and ``startup/`` (IPython.display stand-in, the stub
  finder of ``startup/sitecustomize.py``) first on ``sys.path``.

Then it imports MODULE... (default: the engine's start-up modules and the Llama/Qwen3 path, then LATE_MODULES) and, with
``--dispatch``, runs RMSNorm (with and without residual) and SiluAndMul through SGLang's own dispatch (which picks
``forward_cuda`` here, i.e. the stand-in's ops) against their ``forward_native`` on CPU tensors; with
``--jit-paths``, which calls of that path reach SGLang's own JIT kernels instead (``jit_paths``). JIT builds raise
here (SGLANG_CRASH_ON_JIT_COMPILE=1). Set SGLANG_FORCE_FUSED_OP_BACKEND=torch to see SGLang's switch at work.
Prints one JSON object: imported, failed (module -> error), stubbed (the start-up stubs' placeholder modules made),
image_placeholders (IMAGE_ONLY names made placeholders), hidden (distributions hidden), dispatch (check -> error
ratio, at most 1 to pass), jit_paths (call -> what it reached). Exit status 1 if any import or dispatch check failed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import importlib.metadata
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

DEFAULT_MODULES = (
    "sglang", "sglang.srt.entrypoints.engine", "sglang.srt.managers.scheduler", "sglang.srt.managers.tp_worker",
    "sglang.srt.managers.tokenizer_manager", "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner", "sglang.srt.model_loader.loader",
    "sglang.srt.layers.attention.triton_backend", "sglang.srt.layers.sampler", "sglang.srt.layers.logits_processor",
    "sglang.srt.layers.layernorm", "sglang.srt.layers.activation", "sglang.srt.layers.rotary_embedding",
    "sglang.srt.layers.dual_gemm",
    "sglang.srt.models.llama", "sglang.srt.models.qwen3", "sglang.srt.models.utils",
    "sglang.srt.mem_cache.memory_pool", "sglang.srt.mem_cache.memory_pool_host", "sglang.srt.mem_cache.allocation",
    "sglang.srt.mem_cache.radix_cache", "sglang.srt.constrained.xgrammar_backend",
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner",
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner",
    "sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend",
    "sglang.srt.model_executor.runner_backend.full_cuda_graph_backend",
    "sglang.srt.model_executor.runner_backend_utils.weak_ref_tensor",
    "sglang.srt.distributed.device_communicators.custom_all_reduce_ops",
)
ALWAYS_ALLOWED = {"sglang", "kvzap-export"}
# Modules of packages the GPU image has but an SGLang CPU environment lacks, which SGLang imports on the path above:
# placeholders here, installed only after DEFAULT_MODULES are imported (modules that test them, e.g. breakable CUDA
# graphs' `from cuda.bindings import runtime`, then take their no-cuda-bindings branch instead of a placeholder),
# for LATE_MODULES, which import them unconditionally. Emulation only: the GPU image has the real ones.
IMAGE_ONLY = {"cuda": "cuda-bindings (the image has it: sglang/kernels/ops/gemm/cutedsl_dual_gemm.py:35)"}
LATE_MODULES = ("sglang.kernels.ops.gemm.cutedsl_dual_gemm",)  # DualGemm imports it when an MLP is built on CUDA


def pretend_cuda() -> None:
    import torch

    torch.cuda.is_available = lambda: True
    torch.version.cuda = "13.0"
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.get_device_name = lambda device=None: "pretend sm90 (emulate_gpu_imports.py)"


def allowed_distributions(manifest: Path | None) -> set[str]:
    """The image's packages, SGLang and kvzap-export, and the carried wheels: the manifest's, or without one, those
    this environment's installed metadata gives (``installed_closure``)."""
    sys.path.insert(0, str(HERE))
    from engine_bundle import closure  # noqa: E402  (the builder's own reader and rules)
    from packaging.utils import canonicalize_name

    image = closure.read_image_list(HERE / "gpu_image_packages.txt")
    if manifest is not None:
        carried = {canonicalize_name(w["name"]) for w in json.loads(manifest.read_text())["wheels"]}
    else:
        carried = installed_closure(closure, image)
    return set(image) | carried | ALWAYS_ALLOWED


def installed_closure(closure, image) -> set[str]:
    """SGLang's Requires-Dist closure over the distributions installed here, judged as the builder judges (image,
    EXCLUDED, markers for CPython 3.12): an approximation of the bundle's wheels, versions aside."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    carried: set[str] = set()
    queue = ["sglang"]
    while queue:
        try:
            lines = importlib.metadata.requires(queue.pop()) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in lines:
            requirement = Requirement(line)
            name = canonicalize_name(requirement.name)
            if closure.is_active(requirement) and not {name} & (set(closure.EXCLUDED) | set(image) | carried):
                carried.add(name)
                queue.append(name)
    return carried


def hide_distributions(allowed: set[str]) -> list[str]:
    """Wraps sys.meta_path's PathFinder so that modules and metadata of not-allowed distributions are not found
    (a hidden top-level name is still found in this script's folders, where the bundle's stand-ins live)."""
    from packaging.utils import canonicalize_name

    owners: dict[str, set[str]] = {}
    for top, dists in importlib.metadata.packages_distributions().items():
        owners.setdefault(top, set()).update(canonicalize_name(d) for d in dists)
    hidden_tops = {top for top, dists in owners.items() if dists and not dists & allowed}
    hidden_dists = sorted({d for dists in owners.values() for d in dists} - allowed)

    class ImageOnlyPathFinder(importlib.machinery.PathFinder):
        @classmethod
        def find_spec(cls, fullname, path=None, target=None):
            if path is None and fullname in hidden_tops:
                return super().find_spec(fullname, [str(HERE), str(HERE / "startup")], target)
            return super().find_spec(fullname, path, target)

        @classmethod
        def find_distributions(cls, *args, **kwargs):
            return (d for d in super().find_distributions(*args, **kwargs)
                    if canonicalize_name(d.metadata["Name"] or "") in allowed)

    sys.meta_path[:] = [ImageOnlyPathFinder if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
    for name in [m for m in sys.modules if m.partition(".")[0] in hidden_tops]:
        del sys.modules[name]
    return hidden_dists


def use_bundle_startup() -> list[str]:
    """The stand-ins first on sys.path; the start-up stub finder installed as the bundle's sitecustomize would."""
    for name in [m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel.")]:
        del sys.modules[name]
    sys.path[:0] = [str(HERE), str(HERE / "startup")]
    spec = importlib.util.spec_from_file_location("kvzap_gpu_startup", HERE / "startup" / "sitecustomize.py")
    startup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(startup)
    return startup


def dispatch_checks() -> dict[str, float]:
    """SGLang's own dispatch (forward -> forward_cuda -> the stand-in's op) against forward_native, float32 and bf16.

    Each check first makes sure that forward_cuda called the stand-in (a counting wrapper around the name SGLang bound
    at import), then returns max |cuda - native| / (atol + rtol |native|), which must be <= 1.
    """
    import torch
    from sglang.srt.layers import activation, layernorm

    import sgl_kernel

    counts: dict[str, int] = {}

    def counted(module, attribute: str, standin):
        if getattr(module, attribute) is not standin:
            raise AssertionError(f"{module.__name__}.{attribute} is not the stand-in's {standin.__name__}")

        def wrapper(*args, **kwargs):
            counts[attribute] = counts.get(attribute, 0) + 1
            return standin(*args, **kwargs)

        setattr(module, attribute, wrapper)

    counted(layernorm, "rmsnorm", sgl_kernel.rmsnorm)
    counted(layernorm, "fused_add_rmsnorm", sgl_kernel.fused_add_rmsnorm)
    counted(activation, "_sgl_silu_and_mul", sgl_kernel.silu_and_mul)
    torch.manual_seed(0)
    results = {}
    # width: SiluAndMul.forward_cuda sends an output width that is not a multiple of 16 bytes' worth of elements to
    # sgl-kernel (activation.py:_jit_act_supported); the input rows must still be 16-byte multiples for sgl-kernel.
    for dtype, atol, rtol, width in ((torch.float32, 1e-6, 1e-5, 102), (torch.bfloat16, 1e-3, 2 ** -6, 100)):
        def ratio(got, want):
            return ((got.float() - want.float()).abs() / (atol + rtol * want.float().abs())).max().item()

        name = str(dtype).removeprefix("torch.")
        norm = layernorm.RMSNorm(64, eps=1e-5).to(dtype)
        norm.weight.data.uniform_(0.5, 1.5)
        # rows from 1e-3 to 1 in scale: where mean(x**2) is near eps, a wrong eps shows
        x = (torch.randn(5, 64) * torch.logspace(-3, 0, 5)[:, None]).to(dtype)
        residual = (torch.randn(5, 64) * torch.logspace(-3, 0, 5)[:, None]).to(dtype)
        results[f"rmsnorm_{name}"] = ratio(norm.forward(x.clone()), norm.forward_native(x.clone()))
        got, got_residual = norm.forward(x.clone(), residual.clone())
        want, want_residual = norm.forward_native(x.clone(), residual.clone())
        results[f"fused_add_rmsnorm_{name}"] = max(ratio(got, want), ratio(got_residual, want_residual))
        act, gate_up = activation.SiluAndMul(), torch.randn(3, 2 * width, dtype=dtype)
        results[f"silu_and_mul_{name}"] = ratio(act.forward(gate_up), act.forward_native(gate_up))
    expected = {"rmsnorm": 2, "fused_add_rmsnorm": 2, "_sgl_silu_and_mul": 2}
    if counts != expected:
        raise AssertionError(f"stand-in calls through SGLang's dispatch: {counts}, expected {expected}")
    for key, value in results.items():
        if not value <= 1.0:
            raise AssertionError(f"{key}: forward_cuda (stand-in) differs from forward_native: error ratio {value:.3g}")
    return results


def jit_paths() -> dict[str, str]:
    """Where the Llama/Qwen3 CUDA path reaches SGLang's own JIT kernels (sglang.kernels, tvm-ffi + nvcc) rather
    than sgl-kernel: each call on CPU tensors, with SGLANG_CRASH_ON_JIT_COMPILE=1 (set by main) so that a JIT build
    raises instead of compiling. Answers 'jit: <error>' (the path needs a JIT kernel), 'torch' (it ran in torch), or
    for the two probes SGLang wraps, 'jit-probe -> fallback' (the build failed and SGLang falls back to torch)."""
    import torch
    from sglang.kernels.ops.attention.clamp_position import clamp_position
    from sglang.kernels.ops.kvcache.kvcache import can_use_store_cache
    from sglang.kernels.ops.layernorm.norm import can_use_fused_inplace_qknorm
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    def attempt(call) -> str:
        try:
            call()
            return "torch"
        except Exception as error:  # noqa: BLE001  (the error says which kernel)
            return f"jit: {type(error).__name__}: {str(error).splitlines()[0][:160]}"

    def rope(head: int):
        emb = RotaryEmbedding(head, head, 64, 10000, True, torch.float32)
        return lambda: emb.forward(torch.arange(3), torch.randn(3, 2 * head), torch.randn(3, head))

    probes = {
        "silu_and_mul, 16-byte-aligned width (activation.py:95)": lambda: SiluAndMul().forward(torch.randn(3, 256)),
        "rotary, head 128 (rotary_embedding/base.py:468)": rope(128),
        "rotary, head 80 (rotary_embedding/base.py:136)": rope(80),
        "clamp_position, decode positions (forward_batch_info.py:1228)": lambda: clamp_position(torch.tensor([3, 5])),
    }
    found = {name: attempt(call) for name, call in probes.items()}
    for name, usable in (("qk-norm, Qwen3 (models/utils.py:521)", lambda: can_use_fused_inplace_qknorm(128, torch.bfloat16)),
                         ("KV store, set_kv_buffer (memory_pool.py:175)", lambda: can_use_store_cache(256))):
        found[name] = "jit-probe -> jit kernel" if usable() else "jit-probe -> fallback to torch"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--manifest", type=Path, default=None, help="the bundle's manifest.json (its wheels count as installed)")
    parser.add_argument("--dispatch", action="store_true", help="also run RMSNorm/SiluAndMul through SGLang's dispatch")
    parser.add_argument("--jit-paths", action="store_true", help="also report which calls reach SGLang's JIT kernels")
    parser.add_argument("modules", nargs="*", default=[*DEFAULT_MODULES, *LATE_MODULES])
    args = parser.parse_args(argv)
    os.environ["SGLANG_CRASH_ON_JIT_COMPILE"] = "1"  # a JIT build here raises, naming its module, instead of compiling

    hidden = hide_distributions(allowed_distributions(args.manifest))
    pretend_cuda()
    startup = use_bundle_startup()
    report = {"imported": [], "failed": {}, "stubbed": [], "image_placeholders": [], "hidden": hidden, "dispatch": {}}
    for module in args.modules:
        if module in LATE_MODULES and not report["image_placeholders"]:
            missing = [name for name in IMAGE_ONLY if importlib.util.find_spec(name) is None]
            sys.meta_path.append(startup.StubFinder(missing))
            report["image_placeholders"] = missing
        try:
            importlib.import_module(module)
            report["imported"].append(module)
        except Exception as error:  # noqa: BLE001  (every failure is reported, by module)
            report["failed"][module] = f"{type(error).__name__}: {error}"
    report["stubbed"] = [name for name in startup.CREATED if name.partition(".")[0] in startup.STUBS]
    if args.dispatch and not report["failed"]:
        try:
            report["dispatch"] = dispatch_checks()
        except Exception as error:  # noqa: BLE001
            report["failed"]["--dispatch"] = f"{type(error).__name__}: {error}"
    if args.jit_paths and report["imported"] == args.modules:
        report["jit_paths"] = jit_paths()
    print(json.dumps(report, indent=1))
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
