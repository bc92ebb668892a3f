"""The SGLang server settings KVzap depends on, read from the scheduler when it is built.

A wrong one stops the launch with one line naming the flag that fixes it (``plugin.py`` checks them in an
AFTER hook on ``Scheduler.__init__``, before any request is served).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvzap_export.integrations.scoring import UNQUANTIZED_DTYPES
from kvzap_export.integrations.sglang.api import sglang_module

log = logging.getLogger(__name__)


GRAPHS_PROBLEM = ("graphs are captured (add --cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled: "
                  "graph replay skips KVzap's Python hooks)")
PREFILL_GRAPHS_PROBLEM = ("prefill graphs are captured (add --cuda-graph-backend-prefill disabled: ragged mode lays out "
                          "each prompt in Python, which a prefill graph would freeze; its decode graphs are supported)")


def graph_phases() -> tuple[bool, bool]:
    """(decode, prefill): whether SGLang's published graph configuration captures that phase."""
    config = sglang_module("sglang.srt.model_executor.cuda_graph_config")
    return (not config.check_cuda_graph_backend("decode", "disabled"),
            not config.check_cuda_graph_backend("prefill", "disabled"))


def torch_compile() -> bool:
    """``--enable-torch-compile``: on the CPU engine it is what makes SGLang capture (CPU) graphs."""
    return bool(sglang_module("sglang.srt.runtime_context").get_exec().graph.enable_torch_compile)


def graphs_problem(mode: str) -> str | None:
    """The graph settings' problem for ``mode``, read from SGLang's graph configuration: callable before the model runner
    captures (``plugin.py`` checks it in a BEFORE hook on ``ModelRunner.init_cuda_graphs``, so a launch that needs
    graphs off stops in one line instead of dying inside the capture). Ragged mode runs its decode in CUDA graphs
    (its backend lays each step out in fixed buffers: ``ragged_decode.py``); the masking modes run none."""
    decode, prefill = graph_phases()
    if mode != "ragged":
        return GRAPHS_PROBLEM if decode or prefill else None
    from kvzap_export.integrations.sglang.ragged_decode import ENV, graphs_allowed

    if prefill:
        return PREFILL_GRAPHS_PROBLEM
    if torch_compile():
        return ("torch.compile is on (drop --enable-torch-compile: it traces ragged mode's Python into graphs, and on "
                "the CPU engine makes SGLang capture CPU graphs the backend does not implement)")
    if decode and not graphs_allowed():
        return (f"decode graphs are captured with {ENV}=torch (add --cuda-graph-backend-decode disabled, or unset "
                f"{ENV}: only SGLang's decode kernel runs in graphs)")
    return None


def prefill_graphs_default(server_args, previous) -> None:
    """SGLang's ``handle_cuda_graph_config`` resolution step, wrapped for ragged mode (``register_resolution_hook``,
    SGLang's extension point for its argument resolution): SGLang 0.5.23 captures breakable prefill graphs by default
    on CUDA, which ragged mode cannot run (it lays each prompt out in Python), so a default launch turns them off here,
    with one log line, instead of stopping. A prefill backend the user asked for is left alone (the launch check then
    refuses it in one line). Decode graphs keep SGLang's setting: ragged mode replays them."""
    previous(server_args)
    overrides = sglang_module("sglang.srt.arg_groups.overrides")
    graphs = sglang_module("sglang.srt.model_executor.cuda_graph_config")
    config = overrides.resolving_view(server_args).cuda_graph_config
    chosen = (graphs.Phase.PREFILL, "backend") in getattr(server_args, "_cuda_graph_config_locked", set())
    if config is None or chosen or config.prefill.backend == graphs.Backend.DISABLED:
        return
    overrides.declare_resolution(server_args, "kvzap_ragged_prefill_graphs", cuda_graph_config=graphs.with_phase(
        config, graphs.Phase.PREFILL, backend=graphs.Backend.DISABLED))
    log.warning("KVzap ragged mode: prefill CUDA graphs off (SGLang's default was %s; ragged mode lays each prompt out "
                "in Python); decode graphs as SGLang set them", config.prefill.backend)


SPECULATIVE_PROBLEM = "speculative decoding is on (drop --speculative-algorithm)"


def pipeline_problem(pp_size: int) -> str | None:
    return f"pipeline parallelism is {pp_size} (use --pp-size 1)" if pp_size != 1 else None


def runner_problem(model_runner) -> str | None:
    """Settings ``ServerSetup`` refuses that SGLang acts on before the scheduler exists, read from the model runner
    before it captures (``plugin.py``'s BEFORE hook on ``init_cuda_graphs``): speculative decoding (a draft worker
    captures and warms up through KVzap's backend) and pipeline parallelism (with SGLang's opt-in DeepGEMM warm-up, a
    dummy forward the ragged backend has no layout for)."""
    spec = getattr(model_runner, "spec_algorithm", None)
    if spec is not None and not spec.is_none():
        return SPECULATIVE_PROBLEM
    return pipeline_problem(int(sglang_module("sglang.srt.runtime_context").get_parallel().pp_size))


def autotune_hook(original_fn, model_runner, *args, **kwargs) -> bool:
    """AROUND ``should_run_flashinfer_autotune`` in ragged mode: SGLang 0.5.23 tunes FlashInfer's MoE and FP4/FP8 GEMM
    kernels (quantized or MoE models, SM 90 and newer) with a dummy forward built outside any scheduled batch, which
    has no ragged layout (the backend lays out only batches the scheduler allocated): where SGLang would run it, it is
    skipped, with one log line, and those kernels keep FlashInfer's default tactics. Elsewhere SGLang's answer."""
    if not original_fn(model_runner, *args, **kwargs):
        return False
    log.warning("KVzap ragged mode: SGLang's FlashInfer autotune skipped (its dummy forward has no ragged layout); "
                "FlashInfer's MoE/FP4/FP8 kernels use their default tactics")
    return False


RAGGED_TREE = "KVzapRaggedRadixCache"  # ragged_radix.py's tree (ragged mode's radix cache)


@dataclass(frozen=True)
class ServerSetup:
    """What ``problems(mode)`` needs to know about one scheduler.

    Evict mode moves K/V inside a request's own slots and frees the tail, which is only sound when a slot belongs to one
    request (no radix cache; mask mode needs it off too; ragged mode runs it with KVzap's tree), is freed one by one
    (page size 1), is addressed physically (no unified memory, no decode context parallelism) and stores plain K/V (no
    quantized cache: its reads are dequantized copies and its scales would stay behind). SGLang's overlap scheduler is
    fine in every mode: the step end, an AFTER hook on ``run_batch``, runs before the next batch is prepared in both of
    SGLang's loops. Every mode needs every layer in this process (no pipeline parallelism), ranks that schedule the same
    requests (no attention data parallelism), a cache that stays on this server (no prefill/decode disaggregation, whose
    transfers read logical lengths), Python hooks that run once per forward at every step (no speculative decoding, no
    PD multiplexing, no two-batch overlap; no CUDA graphs, except ragged mode's decode graphs) and decode rows that go
    through the decode path (no mixed chunks: the masking backends mask decode, not extend).
    """

    radix_cache: bool
    page_size: int
    speculative: bool
    mixed_chunk: bool
    unified_memory: bool
    dcp_size: int
    pp_size: int
    attn_dp_size: int
    disaggregation: str
    kv_dtype: torch.dtype
    kv_quantized: bool
    kv_slots: int  # slot ids the allocator hands out (pool or allocator size, the larger, + padding page)
    prefill_backend: str = ""  # the attention backends in effect (``--attention-backend`` unless overridden)
    decode_backend: str = ""
    decode_graphs: bool = False  # CUDA graphs captured for decode
    prefill_graphs: bool = False  # CUDA graphs captured for prefill
    tp_size: int = 1
    kv_heads: int = 0  # the model's KV heads (all ranks together)
    radix_tree: str = ""  # the class of SGLang's tree cache (ragged mode shares prefixes through KVzap's own)
    pdmux: bool = False  # PD multiplexing (--enable-pdmux): a prompt's forward split into layer groups
    two_batch_overlap: bool = False  # --enable-two-batch-overlap: a batch's forward as two micro-batches

    @classmethod
    def of(cls, scheduler) -> "ServerSetup":
        context = sglang_module("sglang.srt.runtime_context")
        parallel = context.get_parallel()
        allocator = scheduler.token_to_kv_pool_allocator
        kv = allocator.get_kvcache()
        kernel = context.get_exec().kernel
        decode_graphs, prefill_graphs = graph_phases()
        backend = kernel.attention_backend or ""
        return cls(radix_cache=not getattr(scheduler.tree_cache, "disable", False),
                   page_size=int(scheduler.page_size), speculative=not scheduler.spec_algorithm.is_none(),
                   mixed_chunk=bool(scheduler.is_mixed_chunk),
                   unified_memory=bool(context.get_memory().enable_unified_memory), dcp_size=int(parallel.dcp_size),
                   pp_size=int(parallel.pp_size), attn_dp_size=int(parallel.attn_dp_size),
                   disaggregation=str(context.get_disagg().disaggregation_mode), kv_dtype=kv.dtype,
                   kv_quantized=bool(getattr(kv, "is_quantized_kv_cache", False)), kv_slots=int(max(kv.size, allocator.size) + kv.page_size),
                   prefill_backend=str(kernel.prefill_attention_backend or backend),
                   decode_backend=str(kernel.decode_attention_backend or backend), decode_graphs=decode_graphs,
                   prefill_graphs=prefill_graphs,
                   tp_size=int(parallel.tp_size), kv_heads=int(scheduler.model_config.get_total_num_kv_heads()),
                   radix_tree=type(scheduler.tree_cache).__name__,
                   pdmux=bool(scheduler.enable_pdmux),
                   two_batch_overlap=bool(context.get_exec().overlap.enable_two_batch_overlap))

    def problems(self, mode: str, decode_backends: tuple[str, ...] = (), prefill_backends: tuple[str, ...] = ()) -> list[str]:
        """Each setting that is wrong for ``mode``, with the flag that fixes it.

        decode_backends / prefill_backends: the attention backends that can serve ``mode`` in each phase
        (empty: any; mask mode needs one of its own for decode, ragged mode for both).
        """
        out = []
        if self.radix_cache and mode != "ragged":
            out.append("the radix cache is on (add --disable-radix-cache)")
        elif self.radix_cache and self.radix_tree != RAGGED_TREE:
            out.append(f"the radix cache is on with another tree than KVzap's ({self.radix_tree}: drop "
                       "--radix-cache-backend and --enable-hierarchical-cache, or add --disable-radix-cache)")
        if mode == "ragged" and self.prefill_graphs:
            out.append(PREFILL_GRAPHS_PROBLEM)
        elif mode != "ragged" and (self.decode_graphs or self.prefill_graphs):
            out.append(GRAPHS_PROBLEM)
        if self.pdmux:
            out.append("PD multiplexing is on (drop --enable-pdmux: it runs a prompt's forward in layer splits, one "
                       "run_batch each, and KVzap's step end decides a prompt once its whole forward has run)")
        if self.speculative:
            out.append(SPECULATIVE_PROBLEM)
        if self.two_batch_overlap:
            out.append("two-batch overlap is on (drop --enable-two-batch-overlap: it runs a batch as two micro-batches, "
                       "each with its own attention metadata, and KVzap lays a step out once per forward)")
        if self.unified_memory:
            out.append("unified memory is on (drop --enable-unified-memory)")
        if self.dcp_size != 1:
            out.append(f"decode context parallelism is {self.dcp_size} (use --dcp-size 1)")
        if self.pp_size != 1:
            out.append(pipeline_problem(self.pp_size))
        if self.attn_dp_size != 1:
            out.append(f"attention data parallelism is {self.attn_dp_size} (use --attn-dp-size 1)")
        if self.disaggregation != "null":
            out.append(f"prefill/decode disaggregation is on ({self.disaggregation}; drop --disaggregation-mode)")
        for phase, chosen, allowed in (("decode", self.decode_backend, decode_backends),
                                       ("prefill", self.prefill_backend, prefill_backends)):
            if allowed and chosen not in allowed:
                out.append(f"the {phase} attention backend is {chosen or 'the default'} "
                           f"(use --attention-backend {' or '.join(allowed)})")
        if self.mixed_chunk:
            out.append("mixed chunks run decode rows through the extend path, which KVzap does not mask "
                       "(drop --enable-mixed-chunk)")
        if mode == "ragged" and self.tp_size > self.kv_heads > 0:
            # SGLang replicates KV heads over ranks then; ragged mode is not tested with replicated heads
            out.append(f"tensor parallelism is {self.tp_size} for {self.kv_heads} KV heads, which SGLang would replicate "
                       f"over ranks (use --tp-size {self.kv_heads} or fewer in ragged mode, or KVZAP_MODE=mask)")
        if mode in ("evict", "ragged") and self.page_size != 1:
            out.append(f"the page size is {self.page_size} (use --page-size 1: entries are freed one by one)")
        if self.kv_quantized or self.kv_dtype not in UNQUANTIZED_DTYPES:
            out.append(f"the KV cache is quantized ({self.kv_dtype}; use --kv-cache-dtype auto: KVzap's decode reads "
                       "plain K/V)")
        return out


def tp_group():
    """SGLang's tensor-parallel ``GroupCoordinator`` once its distributed state exists (scheduler processes); None in a
    plain process."""
    try:
        return sglang_module("sglang.srt.distributed.parallel_state").get_tp_group()
    except (AssertionError, AttributeError, RuntimeError):
        return None


def tp_size_rank() -> tuple[int, int]:
    """(ranks, this process's rank) of tensor parallelism; (1, 0) outside SGLang's scheduler processes."""
    group = tp_group()
    return (group.world_size, group.rank_in_group) if group is not None else (1, 0)
