"""Runs prompts greedily through a real ``sglang.Engine`` with the KVzap plugin, one request at a time.

Run in the engine's environment (``python -m kvzap_export.integrations.sglang.driver SPEC.json OUT.json``);
``validate --engine sglang`` writes the spec, starts this with the engine environment's Python and reads
the result. One engine launch per spec: the plugin is configured by ``KVZAP_*`` before the engine starts
(SGLang loads it in each of its processes), and each request picks its own setting through
``custom_params["kvzap"]`` (``off``: KVzap leaves it alone, the dense reading; ``prefill`` / ``decoding``:
kvpress ``decoding=False`` / ``True``). Requests run one at a time so that the allocator's readings at a
request's last step belong to that request alone.

Spec: ``{"model", "bundle", "mode", "prompts": [{"input_ids": [...]} | {"text": "..."}], "runs": ["off",
"prefill", "decoding"], "max_new_tokens", "engine": {extra sglang.Engine keyword arguments}}``.
Result: ``{"engine": {...}, "results": [{"prompt", "prompt_ids", "run", "output_ids", "reading", "cached_tokens"},
...]}``; ``reading`` is the request's last line of ``stats.AllocatorReadings``; ``cached_tokens`` as below (the
prompts run in order, each run after the last: with the radix cache on, a later one can take a prefix from it).

Stream spec (``"stream": [{"input_ids", "max_new_tokens", "kvzap", "abort_after"?}, ...]``, optional
``"threshold"``: τ instead of the bundle's): every request is submitted at once (SGLang admits them as its
memory allows), those with ``abort_after`` are aborted that many seconds after submission; mode ``dense`` runs
SGLang without KVzap (readings only); ``"server_info": true`` adds SGLang's internal state per data-parallel replica
(``Engine.get_server_info()["internal_states"]``, KVzap's figures under ``"kvzap"``). Result: ``{"engine", "stream": [{"rid", "output_ids", "finish", "seconds",
"t_submit", "t_done", "prompt_tokens", "cached_tokens"}], "readings": [every reading line], "wall_seconds"}``;
``t_submit`` / ``t_done`` are wall-clock times (``time.time()``, the clock of the readings); ``cached_tokens``: the
prompt tokens SGLang took from its radix cache (SGLang's ``meta_info``; 0 with the cache off). ``gpu_memory``: on a
CUDA machine, the device's memory in use at the stream's end, read from NVML (every process: SGLang's scheduler, where
the model runs, keeps its caching allocator's peak reservation; this process opens no CUDA context), its total, and
``mem_fraction_static`` as SGLang resolved it (its plan for weights and K/V); None elsewhere.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import MappingProxyType

# The settings every mode needs on any machine (docs/integrations.md); the CPU needs the torch_native family.
# Chunked prefill stays at SGLang's own default size (a prompt is decided at its last chunk, as kvpress decides it
# at the prompt's end); a spec's "engine" overrides any of these (the benchmark's "dense, radix" turns the radix
# cache back on for SGLang without KVzap). Ragged mode runs with the radix cache on (RADIX_MODES); every mode with
# SGLang's overlap scheduler on, its default (KVzap's step end runs before the next batch is prepared: plugin.py).
# CUDA graphs: SGLang's defaults, except in the masking modes (NO_GRAPH_MODES), whose Python hooks graph replay
# would skip; ragged mode replays decode graphs and turns SGLang's default prefill graphs off itself (plugin.py).
BASE_ENGINE_ARGS = MappingProxyType({
    "disable_radix_cache": True, "page_size": 1, "log_level": "warning", "skip_server_warmup": True,
})
NO_GRAPH_MODES = ("evict", "mask")
NO_GRAPHS = MappingProxyType({"cuda_graph_backend_decode": "disabled", "cuda_graph_backend_prefill": "disabled"})
RADIX_MODES = ("ragged",)  # the modes that run with SGLang's radix cache on (the others need it off)
MODE_ATTENTION = MappingProxyType({"evict": "kvzap_native", "mask": "kvzap_native", "ragged": "kvzap_ragged",
                                   "dense": "torch_native"})
# dense: SGLang's default
GPU_ATTENTION = MappingProxyType({"evict": "kvzap_flex", "mask": "kvzap_flex", "ragged": "kvzap_ragged"})


def engine_args(spec: dict) -> dict:
    """The engine's keyword arguments. The model's dtype: the spec's ``dtype`` when given (``validate`` asks for float32:
    its kvpress reference is float32); otherwise bfloat16 on a GPU, what a deployment serves, and float32 on the CPU
    engine (the dtype of every CPU figure and reference of this project)."""
    cpu = os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"
    args = {"model_path": spec["model"], "dtype": spec.get("dtype") or ("float32" if cpu else "bfloat16"), **BASE_ENGINE_ARGS}
    if cpu:
        # SGLang's default static-memory fraction comes out negative on a CPU with other work on it; the KV
        # pool's size is set by max_total_tokens anyway.
        # (an unknown mode keeps SGLang's CPU backend: the plugin, loaded by the engine, names what is wrong)
        args.update(device="cpu", attention_backend=MODE_ATTENTION.get(spec["mode"], "torch_native"),
                    mem_fraction_static=0.5)
    elif spec["mode"] in GPU_ATTENTION:
        args["attention_backend"] = GPU_ATTENTION[spec["mode"]]
    if spec["mode"] in RADIX_MODES:  # SGLang's default: on (KVzap's tree shares prompts' per-head entries exactly)
        args["disable_radix_cache"] = False
    if spec["mode"] in NO_GRAPH_MODES:
        args.update(NO_GRAPHS)
    args.update(spec.get("engine") or {})
    if cpu and ranks(args) > 1:
        # SGLang's CPU engine cannot size each rank's pool when ranks outnumber NUMA nodes; it asks for a fixed one
        args.setdefault("max_total_tokens", CPU_RANKS_POOL_TOKENS)
    return args


CPU_RANKS_POOL_TOKENS = 16384  # the KV pool of each rank on the CPU engine with several ranks, unless the spec sets one


def ranks(args: dict) -> int:
    """Scheduler processes an engine launch starts (tensor-parallel ranks times data-parallel replicas)."""
    return int(args.get("tp_size") or 1) * int(args.get("dp_size") or 1)


def bind_cpu_ranks(args: dict) -> None:
    """On the CPU engine with several ranks: SGLang binds each rank to the cores of one NUMA node unless
    ``SGLANG_CPU_OMP_THREADS_BIND`` says otherwise, and refuses more ranks than nodes; split this process's cores
    evenly over the ranks instead (left alone when the caller set it)."""
    n = ranks(args)
    if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1" or n <= 1 or os.environ.get("SGLANG_CPU_OMP_THREADS_BIND"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < n:
        raise SystemExit(f"kvzap-sglang-driver: {n} engine ranks need at least {n} cores; this process may use "
                         f"{len(cores)} (lower --tp-size / dp_size)")
    share = len(cores) // n
    groups = [cores[i * share:(i + 1) * share] for i in range(n)]
    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(_core_ranges(g) for g in groups)


def exact_float32(args: dict) -> None:
    """A float32 launch on a GPU (validate's, against kvpress's float32 reference) computes float32 in IEEE precision:
    Triton's ``tl.dot`` multiplies float32 in TF32 unless ``TRITON_F32_DEFAULT`` says otherwise, and SGLang's Triton
    attention kernels (the dense backend's, and ragged mode's decode over the flattened rows) leave it at that. Left
    alone when the caller set it, on the CPU engine and in bfloat16."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1" and args.get("dtype") == "float32":
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")


def _core_ranges(cores: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (SGLang's notation for a rank's cores)."""
    out, start = [], cores[0]
    for a, b in zip(cores, cores[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a != start else str(a))
            start = b
    return ",".join(out)


def read_readings(path: Path) -> list[dict]:
    """The reading lines written to ``path`` so far. Each write appends whole lines at once (stats.py), but a read
    while a scheduler writes (e.g. its idle reading after the last request) may see the end of that write cut short:
    only lines ending in a newline count."""
    if not path.is_file():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def _last_reading(path: Path, rid: str) -> dict | None:
    """The last reading of request ``rid``: tensor-parallel rank 0's, with ``ranks`` (each rank's last, by rank) when
    more than one rank wrote (each holds its own KV heads)."""
    last: dict[int, dict] = {}
    for entry in read_readings(path):
        if entry.get("rid") == rid:
            last[int(entry.get("tp_rank") or 0)] = entry
    if not last:
        return None
    first = dict(last[min(last)])
    if len(last) > 1:
        first["ranks"] = [last[r] for r in sorted(last)]
    return first


# The model modules SGLang needs for the architectures KVzap's glue scores (api.SCORED_ATTENTION).
SCORED_MODULES = MappingProxyType({"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"})


def skip_other_models(model: str) -> None:
    """SGLang's model registry imports every model module at start (tens of seconds on 2 CPU cores); for a
    model whose module is known, tell it to skip the others (its own ``SGLANG_DISABLED_MODEL_ARCHS``)."""
    import importlib.util
    import pkgutil

    try:
        architectures = json.loads((Path(model) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return
    keep = {SCORED_MODULES[a] for a in architectures if a in SCORED_MODULES}
    spec = importlib.util.find_spec("sglang.srt.models")
    if not keep or spec is None or os.environ.get("SGLANG_DISABLED_MODEL_ARCHS"):
        return
    names = [m.name for m in pkgutil.iter_modules(spec.submodule_search_locations) if not m.ispkg]
    os.environ["SGLANG_DISABLED_MODEL_ARCHS"] = ",".join(n for n in names if n not in keep)


def _launch(spec: dict):
    """(engine, readings path, launch seconds) with the plugin configured for ``spec["mode"]``. The readings' folder
    is removed when this process exits (a launch's readings run to megabytes)."""
    folder = tempfile.mkdtemp(prefix="kvzap-sglang-")
    atexit.register(shutil.rmtree, folder, True)
    stats = Path(folder) / "readings.jsonl"
    os.environ["KVZAP_STATS"] = str(stats)
    if spec["mode"] == "dense":
        os.environ.pop("KVZAP_BUNDLE", None)
    else:
        os.environ.update(KVZAP_BUNDLE=str(spec["bundle"]), KVZAP_MODE=spec["mode"], KVZAP_DECODING="1")
    if spec.get("threshold") is not None:
        os.environ["KVZAP_THRESHOLD"] = str(spec["threshold"])
    else:
        os.environ.pop("KVZAP_THRESHOLD", None)
    skip_other_models(spec["model"])
    import sglang

    args = engine_args(spec)
    bind_cpu_ranks(args)
    exact_float32(args)
    started = time.perf_counter()
    engine = sglang.Engine(**args)
    return engine, stats, time.perf_counter() - started


RESOLVED = ("chunked_prefill_size", "disable_radix_cache", "disable_overlap_schedule", "max_prefill_tokens")


def _engine_info(spec: dict, launch_s: float, engine=None) -> dict:
    """The versions, the arguments we passed, and what SGLang resolved for the settings KVzap depends on (e.g. its
    default chunk size for this machine)."""
    import importlib.metadata as md

    server_args = getattr(engine, "server_args", None)
    # SGLang keeps what it decided for its defaults as declarations over the given arguments: resolved_dict() applies them
    settled = server_args.resolved_dict() if server_args is not None else {}
    resolved = {k: settled[k] for k in RESOLVED if k in settled}
    return {"sglang": md.version("sglang"), "torch": md.version("torch"), "args": engine_args(spec),
            "resolved": resolved, "launch_seconds": launch_s}


def _gpu_memory(engine) -> dict | None:
    """The ``gpu_memory`` field of a stream's result (module docstring)."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        return None
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    try:
        import pynvml

        pynvml.nvmlInit()
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(int(first) if first.isdigit() else 0))
    except Exception:  # no NVML here (a machine without an NVIDIA driver, or without nvidia-ml-py)
        return None
    server_args = getattr(engine, "server_args", None)
    settled = server_args.resolved_dict() if server_args is not None else {}
    return {"used_bytes": int(info.used), "total_bytes": int(info.total), "source": "NVML, whole device, at the stream's end",
            "mem_fraction_static": settled.get("mem_fraction_static")}


def stream(spec: dict) -> dict:
    """Submits every request of ``spec["stream"]`` at once; aborts the ones with ``abort_after``."""
    import asyncio

    engine, stats, launch_s = _launch(spec)

    async def one(i: int, request: dict) -> dict:
        rid = f"kvzap-stream-{i}"
        params = {"temperature": 0.0, "max_new_tokens": request["max_new_tokens"], "ignore_eos": True}
        if spec["mode"] != "dense":
            params["custom_params"] = {"kvzap": request.get("kvzap", "decoding")}
        if request.get("abort_after") is not None:
            async def abort():
                await asyncio.sleep(request["abort_after"])
                engine.tokenizer_manager.abort_request(rid)
            asyncio.ensure_future(abort())
        t0, submitted = time.perf_counter(), time.time()
        try:
            out = await engine.async_generate(input_ids=request["input_ids"], sampling_params=params, rid=rid)
        except ValueError as exc:  # SGLang raises a request's abort message (e.g. a 400) in the caller
            return {"rid": rid, "output_ids": [], "finish": "abort", "error": str(exc), "seconds": time.perf_counter() - t0,
                    "t_submit": submitted, "t_done": time.time()}
        meta = out["meta_info"]
        return {"rid": rid, "output_ids": list(out.get("output_ids") or []),
                "finish": (meta.get("finish_reason") or {}).get("type"), "seconds": time.perf_counter() - t0,
                "t_submit": submitted, "t_done": time.time(), "prompt_tokens": meta.get("prompt_tokens"),
                "cached_tokens": meta.get("cached_tokens")}

    async def everything():
        return await asyncio.gather(*(one(i, r) for i, r in enumerate(spec["stream"])))

    try:
        t0 = time.perf_counter()
        results = engine.loop.run_until_complete(everything())
        wall = time.perf_counter() - t0
        time.sleep(spec.get("settle_seconds", 2.0))  # the scheduler goes idle and writes its idle reading
        memory = _gpu_memory(engine)
        info = engine.get_server_info() if spec.get("server_info") else None
    finally:
        engine.shutdown()
    readings = read_readings(stats)
    out = {"engine": _engine_info(spec, launch_s, engine), "stream": results, "readings": readings, "wall_seconds": wall,
           "gpu_memory": memory}
    if info is not None:
        out["server_info"] = {"internal_states": info.get("internal_states")}
    return out


def run(spec: dict, progress=None) -> dict:
    if spec.get("stream"):
        return stream(spec)
    engine, stats, launch_s = _launch(spec)
    results = []
    try:
        tokenizer = engine.tokenizer_manager.tokenizer
        for p, prompt in enumerate(spec["prompts"]):
            ids = list(prompt["input_ids"]) if "input_ids" in prompt else list(tokenizer(prompt["text"])["input_ids"])
            for choice in spec["runs"]:
                t0 = time.perf_counter()
                out = engine.generate(input_ids=ids, sampling_params={
                    "temperature": 0.0, "max_new_tokens": spec["max_new_tokens"], "ignore_eos": True,
                    "custom_params": {"kvzap": choice}})
                rid = out["meta_info"]["id"]
                results.append({"prompt": p, "prompt_ids": ids, "run": choice, "output_ids": list(out["output_ids"]),
                                "reading": _last_reading(stats, rid), "seconds": time.perf_counter() - t0,
                                "cached_tokens": out["meta_info"].get("cached_tokens")})
                if progress:
                    progress(p, choice)
    finally:
        engine.shutdown()
    return {"engine": _engine_info(spec, launch_s, engine), "results": results}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m kvzap_export.integrations.sglang.driver SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())

    def progress(prompt: int, choice: str) -> None:
        print(f"kvzap-sglang-driver: prompt {prompt + 1}/{len(spec['prompts'])} run {choice} done", file=sys.stderr,
              flush=True)

    result = run(spec, progress)
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
