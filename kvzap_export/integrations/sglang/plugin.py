"""The SGLang plugin: entry point, hooks, and this process's runtime.

``load_plugin`` is the package's ``sglang.srt.plugins`` entry point; SGLang calls it in each of its
processes before parsing the command line. It does nothing unless ``KVZAP_BUNDLE`` is set. Settings:
``KVZAP_BUNDLE`` (a bundle directory), ``KVZAP_MODE`` (evict | mask | ragged; default evict),
``KVZAP_DECODING`` (1 | 0; default 1: also evict while decoding, kvpress ``decoding=True``),
``KVZAP_THRESHOLD`` (a number: τ instead of the bundle's), ``KVZAP_PRUNED_FRACTION`` (ragged mode, a benchmark
setting for models whose scores mean nothing, e.g. ``--load-format dummy``: τ set once from the first prompts' scores
so that this fraction of them lies below it, logged), ``KVZAP_STATS`` (a file: allocator readings per
request and step and at idle, ``stats.py``; also without a bundle, for a dense baseline). The glue is written
against one SGLang version (``api.SGLANG_VERSION``): with ``KVZAP_BUNDLE`` or ``KVZAP_STATS`` set, any other stops the
launch with one line (unset, the plugin does nothing and SGLang runs as if it were not installed).

Hooks (SGLang's ``HookRegistry``):
  - BEFORE ``LlamaAttention.forward`` / ``Qwen3Attention.forward``: scores the new tokens (their
    ``hidden_states`` is the post-input-RMSNorm attention input);
  - AFTER ``Scheduler.__init__``: reads the server's settings (``ServerSetup``) and stops the launch with one
    line if one is wrong for the mode;
  - AFTER ``Scheduler.run_batch``: the step end (decisions, eviction, readings) of the batch whose forward just ran.
    Both of SGLang's event loops call it before they prepare the next batch: the normal loop right before this
    batch's ``process_batch_result``, the overlap loop at the latest before the previous batch's; so the next forward
    always sees this step's decisions, and the overlap scheduler changes only when SGLang processes results
    (docs/integrations.md, the flags table);
  - AFTER ``ForwardBatch.init_new`` (evict mode): logical RoPE positions.
Mask and evict modes register the ``kvzap_native`` and ``kvzap_flex`` attention backends (decode attends to
exactly kvpress's set); ragged mode registers ``kvzap_ragged`` and replaces the model runner's KV pool.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os

from kvzap_export.errors import ConfigError, KvzapError
from kvzap_export.integrations.host_reads import tallies
from kvzap_export.integrations.sglang.api import SCORED_ATTENTION, api, sglang_module
from kvzap_export.integrations.sglang.runtime import MODES, KVzapSGLang
from kvzap_export.integrations.sglang.server_setup import (ServerSetup, graphs_problem, prefill_graphs_default,
                                                           runner_problem, tp_group, tp_size_rank)
from kvzap_export.integrations.sglang.settings import (check_sglang_version, evict_frees_nothing,
                                                       pruned_fraction_from_env, threshold_from_env)

log = logging.getLogger(__name__)

# Process-wide singletons, forced by SGLang's plugin contract: SGLang calls ``load_plugin`` once in each of its
# processes and every hook as a plain function with SGLang's own arguments, so what ``install`` read (``_CONFIG``, with
# ragged mode's ``RaggedParts``) and the runtime built from it at the first hook call (``_RUNTIME``) can only be
# reached from here. Everything else a hook needs hangs off the runtime (tests/integrations/test_module_state.py).
_CONFIG: dict | None = None
_RUNTIME: KVzapSGLang | None = None


def runtime() -> KVzapSGLang:
    """This process's runtime, built on first use: by then SGLang's tensor-parallel state exists."""
    global _RUNTIME
    if _RUNTIME is None:
        if _CONFIG is None:
            raise ConfigError("KVzap's SGLang runtime is not installed in this process; call install() (or load the plugin)")
        from kvzap_export.integrations.sglang.stats import AllocatorReadings

        group = tp_group()
        size, rank = tp_size_rank()
        cfg = _CONFIG
        factory = KVzapSGLang
        if cfg["mode"] == "ragged":
            from kvzap_export.integrations.sglang.ragged import RaggedKVzapSGLang as factory
        rt = factory.from_bundle(cfg["bundle"], cfg["mode"], cfg["decoding"], size, rank, group, **cfg["policy"])
        if cfg.get("pruned_fraction") is not None:
            rt.pruned_fraction = cfg["pruned_fraction"]
        if cfg.get("ragged_parts") is not None:  # what ragged mode's hooks and backend build (ragged_parts.py)
            rt.parts = cfg["ragged_parts"]
        rt.stats = AllocatorReadings.from_env(rank, _dp_rank())
        _RUNTIME = rt
    return _RUNTIME


def _dp_rank() -> int | None:
    """This process's data-parallel replica (None without data parallelism, or outside SGLang's processes)."""
    try:
        rank = sglang_module("sglang.srt.runtime_context").get_parallel().dp_rank
    except (AssertionError, AttributeError, RuntimeError):
        return None
    return int(rank) if rank is not None else None


def _backends(mode: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(decode, prefill) attention backends a mode needs; empty = any."""
    if mode in ("mask", "evict"):
        from kvzap_export.integrations.sglang.masking import BACKENDS

        return BACKENDS, ()
    if mode == "ragged":
        from kvzap_export.integrations.sglang.ragged import BACKEND

        return (BACKEND,), (BACKEND,)
    return (), ()


def one_line(hook):
    """A hook whose ``KvzapError`` stops the process with one line: SGLang would log a traceback (or report a
    failed graph capture) and signal its parent, burying what the operator has to change."""
    @functools.wraps(hook)
    def wrapped(*args, **kwargs):
        try:
            return hook(*args, **kwargs)
        except KvzapError as exc:
            raise SystemExit(f"kvzap-export: {exc}") from None

    return wrapped


@one_line
def _score_hook(attention, *args, **kwargs):
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[1]
    forward_batch = kwargs["forward_batch"] if "forward_batch" in kwargs else args[2]
    rt = runtime()
    if attention.attn.tp_k_head_num != rt.scorer.num_kv_heads:
        raise ConfigError(f"layer {attention.attn.layer_id} holds {attention.attn.tp_k_head_num} KV heads on this rank, "
                          f"the surrogate slice has {rt.scorer.num_kv_heads}; is the bundle for this model?")
    rt.score(attention.attn.layer_id, hidden, forward_batch)


@one_line
def _scheduler_built_hook(result, scheduler, *args, **kwargs):
    """Checks the server's settings once the scheduler exists; a wrong one stops the launch with one line."""
    rt = runtime()
    rt.check_setup(ServerSetup.of(scheduler), *_backends(rt.mode))
    return result


@one_line
def _graphs_hook(model_runner, *args, **kwargs):
    """Before the model runner captures graphs: the masking modes' hooks run in Python, which graph replay skips, and
    ragged mode's extend lays each prompt out in Python; a launch with graphs on where its mode cannot run them stops
    here in one line, as does one with speculative decoding or pipeline parallelism, which SGLang acts on before the
    scheduler exists (``runner_problem``; checked again with every other setting once the scheduler exists)."""
    problem = graphs_problem(_CONFIG["mode"]) or runner_problem(model_runner)
    if problem is not None:
        raise ConfigError(f"KVzap ({_CONFIG['mode']} mode) cannot run on this SGLang server: {problem} "
                          "(stopped before the capture)")


def _ran_batch(args, kwargs):
    """(scheduler, batch) of a ``Scheduler.run_batch(batch, ...)`` call."""
    return args[0], kwargs["batch"] if "batch" in kwargs else args[1]


@contextlib.contextmanager
def _in_forward_stream(scheduler):
    """Runs the step end in stream order with the forward that just ran. Under SGLang's overlap scheduler on a GPU the
    forward runs on ``scheduler.forward_stream``: the step end's work goes on that stream (after the forward, before
    the next one), and the scheduler's own stream then waits for it, because the next batch's preparation (ragged mode:
    entries popped from the free list the step end pushes to) runs there, and SGLang's barrier before it waits only for
    a decode graph's replay. A no-op otherwise (the normal loop, or the CPU engine, where the forward has finished)."""
    stream = getattr(scheduler, "forward_stream", None)
    if not getattr(scheduler, "enable_overlap", False) or stream is None or not hasattr(stream, "cuda_stream"):
        yield
        return
    with scheduler.device_module.stream(stream):
        yield
    scheduler.schedule_stream.wait_stream(stream)


@one_line
def _step_end_hook(result, *args, **kwargs):
    scheduler, batch = _ran_batch(args, kwargs)
    rt = runtime()
    if rt.setup is None:  # a scheduler built before the plugin's hooks were applied
        rt.check_setup(ServerSetup.of(scheduler), *_backends(rt.mode))
    allocator = scheduler.token_to_kv_pool_allocator
    before = allocator.available_size()
    with _in_forward_stream(scheduler):
        rt.on_step_end(batch, getattr(scheduler, "chunked_req", None))
    step_ended = getattr(allocator, "step_ended", None)
    if step_ended is not None:  # ragged mode: tensor-parallel ranks start agreeing on the room (rank_room.py)
        step_ended()
    if rt.stats is not None and (batch.forward_mode.is_extend() or batch.forward_mode.is_decode()) and batch.reqs:
        counts = tallies()
        rt.stats.record(batch, rt, {"host_reads": counts.take()} if counts is not None else None, scheduler)
    if allocator.available_size() > before or getattr(rt, "decided_on_device", False):
        # SGLang stops admitting prefills once one did not fit (``batch_is_full``) and clears that flag only when a
        # request leaves the batch; KVzap's eviction frees memory without any request leaving, so clear it here
        # (ragged mode on a GPU: its decisions' frees reach the host later, so any decision clears it; SGLang sets it
        # again if a prefill still does not fit).
        scheduler.running_batch.batch_is_full = False
        batch.batch_is_full = False


@one_line
def _positions_hook(result, *args, **kwargs):
    runtime().shift_positions(result)


def _exact_at_idle_hook(scheduler, *args, **kwargs):
    """BEFORE ``Scheduler.on_idle`` (ragged mode): once the scheduler is fully idle, the store waits for its last
    snapshot (the device is idle: nothing to wait for long), so SGLang's idle check (``available + evictable ==
    max_total_num_tokens``) reads exact figures, not the lower bounds a GPU's pending snapshot leaves. Tensor-parallel
    ranks agree on what changed since they last did at every loop that ran no batch (every rank reaches it in the same
    loop), fully idle or not: a waiting request that fits only in the room finished requests freed would otherwise wait
    for a step end that never comes."""
    allocator = scheduler.token_to_kv_pool_allocator
    store = getattr(allocator, "store", None)
    if store is not None and (scheduler.is_fully_idle() or (store.ranks is not None and store.ranks.shared)):
        allocator.exact()


@one_line
def _idle_hook(result, scheduler, *args, **kwargs):
    rt = runtime() if _CONFIG is not None else None
    readings = rt.stats if rt is not None else _readings_only()
    if readings is not None and scheduler.is_fully_idle():
        readings.record_idle(scheduler, rt)
    return result


@functools.cache
def _readings_only():
    """This process's readings without KVzap (KVZAP_STATS set, KVZAP_BUNDLE not), made at first use: a process-wide
    singleton for the reason ``_RUNTIME`` is one (the dense hooks have no runtime to hang it on)."""
    from kvzap_export.integrations.sglang.stats import AllocatorReadings

    return AllocatorReadings.from_env(tp_size_rank()[1], _dp_rank())


def _internal_state_hook(result, scheduler, *args, **kwargs):
    """AFTER ``Scheduler.get_internal_state``: KVzap's figures under ``"kvzap"`` in SGLang's internal state, which
    ``/server_info`` (and ``Engine.get_server_info()``) lists per data-parallel replica: the mode, where it runs, and
    the pools' readings at that moment (``stats.AllocatorReadings``' fields; under tensor parallelism rank 0's, its own
    KV heads'). A reading that fails is reported as such, never raised: the request is an operator's query."""
    from kvzap_export.integrations.sglang.stats import AllocatorReadings

    state = getattr(result, "internal_state", None)
    if not isinstance(state, dict) or _CONFIG is None:
        return result
    try:
        rt = runtime()
        size, rank = tp_size_rank()
        state["kvzap"] = {"mode": rt.mode, "tp_rank": rank, "tp_size": size, "dp_rank": _dp_rank(),
                          **AllocatorReadings.pool(scheduler.token_to_kv_pool_allocator, rt,
                                                   getattr(scheduler, "tree_cache", None))}
    except Exception as exc:  # noqa: BLE001 - an operator's query must not stop the scheduler
        state["kvzap"] = {"error": f"{type(exc).__name__}: {exc}"}
    return result


def _dense_step_end_hook(result, *args, **kwargs):
    scheduler, batch = _ran_batch(args, kwargs)
    readings = _readings_only()
    if readings is not None and (batch.forward_mode.is_extend() or batch.forward_mode.is_decode()):
        readings.record(batch, scheduler=scheduler)


def install_readings_only() -> None:
    """Readings of SGLang's allocator without KVzap (the dense baseline; ``KVZAP_STATS`` without a bundle)."""
    hooks = sglang_module("sglang.srt.plugins.hook_registry")
    hooks.HookRegistry.register(api("Scheduler.run_batch").target, _dense_step_end_hook, hooks.HookType.AFTER)
    hooks.HookRegistry.register(api("Scheduler.on_idle").target, _idle_hook, hooks.HookType.AFTER)


def install(bundle, mode: str = "evict", decoding: bool = True, **policy) -> None:
    """Registers KVzap's hooks (and the mode's attention backend) in this process.

    Call it from a ``sglang.srt.plugins`` entry point (see ``load_plugin``) so that every SGLang process
    runs it before the engine starts; ``HookRegistry.apply_hooks`` then patches the targets. The runtime
    (surrogate, buffers, TP slice) is built at the first hook call.
    """
    global _CONFIG, _RUNTIME
    from kvzap_export.bundle.manifest import read_manifest
    from kvzap_export.integrations.core import KVzapPolicy

    if mode not in MODES:
        raise ConfigError(f"KVZAP_MODE={mode!r} is not supported; use one of {list(MODES)}")
    pruned_fraction = policy.pop("pruned_fraction", None)
    if pruned_fraction is not None and mode != "ragged":
        raise ConfigError(f"KVZAP_PRUNED_FRACTION is a ragged-mode benchmark setting (KVZAP_MODE={mode}); unset it")
    if mode == "ragged":  # the decode kernel asked for: a wrong value, or the switch's former name, stops here
        from kvzap_export.integrations.sglang.ragged_decode import chosen_kernel

        chosen_kernel()
    # The manifest and the policy are checked here, in the launching process, so that a wrong bundle or
    # threshold stops the launch; the surrogate itself is loaded by each scheduler process at first use.
    KVzapPolicy.from_manifest(read_manifest(bundle), decoding=decoding, **policy)
    hooks = sglang_module("sglang.srt.plugins.hook_registry")
    _CONFIG, _RUNTIME = {"bundle": str(bundle), "mode": mode, "decoding": decoding, "policy": policy,
                         "pruned_fraction": pruned_fraction}, None
    register, kind = hooks.HookRegistry.register, hooks.HookType
    for name in SCORED_ATTENTION:
        register(api(name).target, _score_hook, kind.BEFORE)
    register(api("ModelRunner.init_cuda_graphs").target, _graphs_hook, kind.BEFORE)
    register(api("Scheduler.__init__").target, _scheduler_built_hook, kind.AFTER)
    register(api("Scheduler.run_batch").target, _step_end_hook, kind.AFTER)
    register(api("Scheduler.on_idle").target, _idle_hook, kind.AFTER)
    register(api("Scheduler.get_internal_state").target, _internal_state_hook, kind.AFTER)
    if mode in ("evict", "mask"):
        from kvzap_export.integrations.sglang import masking

        masking.register(runtime)
        if mode == "evict":
            register(api("ForwardBatch.init_new").target, _positions_hook, kind.AFTER)
    else:
        from kvzap_export.integrations.sglang import ragged

        _CONFIG["ragged_parts"] = ragged.register(register, kind, one_line)
        register(api("Scheduler.on_idle").target, _exact_at_idle_hook, kind.BEFORE)
        resolution = sglang_module(api("register_resolution_hook").module)
        resolution.register_resolution_hook("handle_cuda_graph_config")(prefill_graphs_default)
    if mode == "evict":
        warning = evict_frees_nothing(bundle, policy.get("threshold"))
        if warning:
            log.warning(warning)


def load_plugin() -> None:
    """``sglang.srt.plugins`` entry point: reads ``KVZAP_*`` and installs (see the module docstring).

    SGLang logs and ignores an exception raised by a plugin, which would leave a server running without
    the KVzap its operator asked for; a wrong setting therefore exits the process with one line instead.
    """
    bundle = os.environ.get("KVZAP_BUNDLE")
    if bundle or os.environ.get("KVZAP_STATS"):  # only then does the plugin hook SGLang: another version may differ
        try:
            check_sglang_version()
        except KvzapError as exc:
            raise SystemExit(f"kvzap-export: {exc}") from None
    if not bundle:
        if os.environ.get("KVZAP_STATS"):
            install_readings_only()
            log.info("kvzap-export's SGLang plugin: KVzap is off; allocator readings go to %s", os.environ["KVZAP_STATS"])
        else:
            log.info("kvzap-export's SGLang plugin: KVZAP_BUNDLE is not set, KVzap is off")
        return
    mode = os.environ.get("KVZAP_MODE", "evict")
    decoding = os.environ.get("KVZAP_DECODING", "1").strip().lower()
    try:
        if decoding not in ("1", "0", "true", "false"):
            raise ConfigError(f"KVZAP_DECODING={decoding!r}: use 1 (also evict while decoding) or 0 (prefill only)")
        install(bundle, mode, decoding in ("1", "true"), **threshold_from_env(), **pruned_fraction_from_env())
    except KvzapError as exc:
        raise SystemExit(f"kvzap-export: {exc}") from None
    log.info("KVzap on: bundle %s, mode %s", bundle, mode)
