"""Which wheels SGLang needs on the GPU machine: its ``Requires-Dist`` closure, minus what the machine's image holds and
what we deliberately leave out.

Every requirement is read with ``packaging`` (no hand parsing), its marker evaluated for the target interpreter
(``TARGET_ENV``: CPython 3.12 on Linux x86-64) with no extra taken. A requirement is then met in one of three ways:
the image holds the package (``gpu_image_packages.txt``), the bundle carries its wheel, or ``EXCLUDED`` says why it
is left out. ``compute_closure`` walks the carried wheels' own requirements the same way until nothing is new;
``check_closure`` re-checks a finished list of wheels (the bundle's manifest) and names every requirement that is
met in none of the three ways.
"""

from __future__ import annotations

import email.parser
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

# The GPU machine's interpreter (KINDS.md: Python 3.12.3, x86-64 Linux). The empty extra: extras are not taken.
TARGET_ENV = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "implementation_version": "3.12.3", "platform_python_implementation": "CPython", "os_name": "posix",
    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "platform_release": "",
    "platform_version": "", "extra": "",
}

# Requirements of SGLang 0.5.23 (and of the wheels we carry) that the bundle leaves out on purpose, each with why.
# Names are canonical (PEP 503). Of these, only cutlass (nvidia-cutlass-dsl) and IPython.display are imported on the
# dense CUDA path: stubbed at start-up (scripts/sglang_gpu/startup/); the rest are imported only on paths we do not run
# or inside try/except (scripts/sglang_gpu/emulate_gpu_imports.py checks this on a CPU machine).
EXCLUDED: dict[str, str] = {
    "torch": "the image's CUDA build (2.11.0+cu130) is what runs; SGLang pins 2.14.1, a multi-GB CUDA wheel",
    "sglang-kernel": "CUDA binaries built against torch 2.14; replaced by kvzap-export's stand-in (scripts/sglang_gpu/sgl_kernel)",
    "flashinfer-python": "attention/sampling kernels for backends we do not select (--attention-backend triton, --sampling-backend pytorch)",
    "flash-attn-4": "FlashAttention 4 (Blackwell, CuTe DSL): not on the Triton attention path",
    "cuda-python": "a meta-package; the image's cuda-bindings provides the cuda.bindings modules SGLang imports",
    "humming-kernels": "CUDA kernel library for quantized/MoE paths; not used by dense Llama/Qwen3",
    "nvidia-cutlass-dsl": "CuTe DSL, large; only sm100 kernels use it on our path (DualGemm imports it: stubbed at start-up)",
    "nvidia-mathdx": "cuBLASDx/cuFFTDx headers for CuTe DSL kernels; not on our path",
    "nvshmem4py-cu13": "NVSHMEM for expert-parallel all-to-all; single GPU, no expert parallelism",
    "quack-kernels": "CuTe DSL kernels (Blackwell/Hopper fused ops); not on our path",
    "sgl-deep-ep": "DeepEP expert-parallel communication; no MoE, single GPU",
    "sgl-deep-gemm": "DeepGEMM FP8 GEMMs; models run in bf16/float32",
    "sgl-flash-mla": "FlashMLA (DeepSeek MLA attention); Llama/Qwen3 use MHA/GQA",
    "tilelang": "TileLang kernels (DeepSeek sparse attention); not on our path",
    "torch-memory-saver": "CUDA allocator hook for RL weight offload; imported in try/except (srt/utils/torch_memory_saver_adapter.py:7-19)",
    "torchcodec": "video decoding for multimodal inputs; transformers probes it with find_spec, so it is neither carried nor stubbed",
    "outlines": "an alternative grammar backend (default xgrammar), imported only when chosen (srt/constrained/base_grammar_backend.py:388)",
    "llguidance": "an alternative grammar backend (default xgrammar), imported only when chosen (srt/constrained/base_grammar_backend.py:427)",
    "mistral-common": "Mistral tokenizers (needs pycountry and more); gguf imports it inside try/except",
    "kernels": "Hugging Face kernel hub client: downloads kernels at run time (no network there); transformers probes it with find_spec",
    "modelscope": "a model hub client (no network there); imported only when SGLANG_USE_MODELSCOPE is set",
    "py-spy": "a sampling profiler executable; never imported",
    "deepseek-recipe": "DeepSeek chat renderer, imported lazily by the DeepSeek parser only",
    "tml-renderers": "Inkling chat renderer, imported lazily by that parser only",
    "smg-grpc-servicer": "gRPC encoder/router server for disaggregation; not used by sglang.Engine",
    "ipython": "only IPython.display (HTML, display) is imported, by sglang/utils.py: a two-name stand-in module instead",
}


@dataclass(frozen=True)
class Decision:
    """How one requirement of one wheel is met. verdict: image | carried | excluded | inactive | missing | conflict."""

    requirer: str
    requirement: str
    verdict: str
    detail: str = ""


@dataclass
class Closure:
    """The carried wheels (canonical name -> path) and one decision per requirement read."""

    carried: dict[str, Path] = field(default_factory=dict)
    decisions: list[Decision] = field(default_factory=list)

    def problems(self) -> list[Decision]:
        return [d for d in self.decisions if d.verdict in ("missing", "conflict")]


def read_image_list(path: Path) -> dict[str, Version | None]:
    """``gpu_image_packages.txt``: canonical name -> version (None where the list gives none)."""
    image: dict[str, Version | None] = {}
    for number, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        try:
            image[canonicalize_name(name.strip())] = Version(version.strip()) if version else None
        except InvalidVersion as error:
            raise ValueError(f"{path}:{number}: {raw!r}: {error}") from None
    return image


def wheel_identity(wheel: Path) -> tuple[str, Version]:
    """(canonical name, version) from a wheel's file name."""
    name, version, _, _ = parse_wheel_filename(Path(wheel).name)
    return canonicalize_name(name), version


def wheel_requires(wheel: Path) -> list[str]:
    """The ``Requires-Dist`` lines of a wheel's METADATA, as written."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if len(names) != 1:
            raise ValueError(f"{Path(wheel).name}: expected one *.dist-info/METADATA, found {names}")
        metadata = email.parser.Parser().parsestr(archive.read(names[0]).decode("utf-8"), headersonly=True)
    return list(metadata.get_all("Requires-Dist") or [])


def parse(requirement: str, requirer: str) -> Requirement:
    try:
        return Requirement(requirement)
    except InvalidRequirement as error:
        raise ValueError(f"{requirer}: unreadable Requires-Dist {requirement!r}: {error}") from None


def is_active(requirement: Requirement) -> bool:
    """True when the requirement applies on the target without extras."""
    return requirement.marker is None or requirement.marker.evaluate(dict(TARGET_ENV))


def judge(requirement: Requirement, requirer: str, image: dict[str, Version | None], carried: dict[str, Version],
          excluded: dict[str, str]) -> Decision:
    """How one requirement is met given the image, the wheels carried so far and the exclusions ('missing' if not)."""
    text, name = str(requirement), canonicalize_name(requirement.name)
    if not is_active(requirement):
        return Decision(requirer, text, "inactive", "marker false for CPython 3.12 linux x86_64, no extras")
    if name in excluded:
        return Decision(requirer, text, "excluded", excluded[name])
    if name in image:
        version = image[name]
        if version is not None and not requirement.specifier.contains(version, prereleases=True):
            return Decision(requirer, text, "image", f"the image has {version}, outside {requirement.specifier}")
        return Decision(requirer, text, "image", f"the image has {version or 'it'}")
    if name in carried:
        if not requirement.specifier.contains(carried[name], prereleases=True):
            return Decision(requirer, text, "conflict", f"carried {name} {carried[name]} is outside {requirement.specifier}")
        return Decision(requirer, text, "carried", f"{name} {carried[name]}")
    return Decision(requirer, text, "missing", f"{name} is neither in the image, carried, nor excluded")


def compute_closure(root: Path, image: dict[str, Version | None], fetch: Callable[[Requirement], Path],
                    excluded: dict[str, str] = EXCLUDED, progress: Callable[[str], None] = lambda line: None) -> Closure:
    """Walks ``root``'s requirements and those of every wheel fetched for them; ``fetch`` returns a wheel's path.

    The root wheel itself is not 'carried' (the bundle packs it trimmed). A requirement first met by a fetch is
    'carried'; one that a later requirer constrains differently from what was fetched is a 'conflict'.
    """
    closure = Closure()
    versions: dict[str, Version] = {}
    queue: list[tuple[str, str]] = [(wheel_identity(root)[0], line) for line in wheel_requires(root)]
    while queue:
        requirer, line = queue.pop(0)
        requirement = parse(line, requirer)
        decision = judge(requirement, requirer, image, versions, excluded)
        if decision.verdict == "missing":
            wheel = Path(fetch(requirement))
            name, version = wheel_identity(wheel)
            if name != canonicalize_name(requirement.name):
                raise ValueError(f"fetching {requirement} gave {wheel.name}")
            closure.carried[name], versions[name] = wheel, version
            decision = judge(requirement, requirer, image, versions, excluded)
            progress(f"  + {wheel.name} (for {requirer})")
            queue.extend((name, sub) for sub in wheel_requires(wheel))
        closure.decisions.append(decision)
    return closure


def check_closure(wheels: Iterable[tuple[str, str, list[str]]], image: dict[str, Version | None],
                  excluded: dict[str, str] = EXCLUDED) -> list[Decision]:
    """Re-checks a finished bundle: ``wheels`` are (name, version, Requires-Dist lines), the root (SGLang) included.

    Returns the requirements met in none of the three ways, or met by a carried wheel of a version they exclude.
    """
    wheels = list(wheels)
    carried = {canonicalize_name(name): Version(version) for name, version, _ in wheels}
    problems = []
    for name, _, lines in wheels:
        for line in lines:
            decision = judge(parse(line, name), name, image, carried, excluded)
            if decision.verdict in ("missing", "conflict"):
                problems.append(decision)
    return problems


def find_cached(requirement: Requirement, cache: Path) -> Path | None:
    """The newest wheel in ``cache`` for this requirement whose version it allows (None if there is none)."""
    name = canonicalize_name(requirement.name)
    best: tuple[Version, Path] | None = None
    for wheel in Path(cache).glob("*.whl"):
        try:
            wheel_name, version = wheel_identity(wheel)
        except ValueError:
            continue
        if wheel_name == name and requirement.specifier.contains(version, prereleases=True):
            if best is None or version > best[0]:
                best = (version, wheel)
    return best[1] if best else None
