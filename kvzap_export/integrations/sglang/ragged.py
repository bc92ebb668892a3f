"""Ragged mode (``KVZAP_MODE=ragged``): every (request, layer, KV head) owns its own KV entries in SGLang.

Design: docs/ragged-kv.md. In short: K/V live in a ``RaggedStore`` (one-head entries, one pool for all layers,
heads and requests, ``N · layers · kv_heads`` entries for SGLang's ``N``-token budget), not in SGLang's
buffers; SGLang keeps its logical view (slot ids, ``req_to_token``, ``seq_lens``, positions), but its slots
carry no K/V. Attach points, all SGLang extension points (the pool's in ``ragged_pool.py``):

- AROUND ``SRTPlatform.get_kv_pool_cls``: SGLang's pool becomes a placeholder subclass of
  ``NoOpMHATokenToKVPool`` (no dense K/V buffers are allocated);
- AROUND ``KVCacheConfigurator._build_token_to_kv_pool_allocator``: SGLang's token allocator becomes a
  subclass whose ``available_size()`` is the store's free entries in dense tokens (``free // (layers ·
  kv_heads)``: admission control in dense-token units) and whose logical slot ids grow on demand, so the
  requests admitted follow the memory KVzap freed with no ceiling of ours; it owns the store;
- ``register_attention_backend("kvzap_ragged")``: writes each forward's new K/V into the store and attends per
  head, one call per layer for the batch (``kernels.ragged_attention``; on CUDA, decode goes through SGLang's decode
  kernel over buffers laid out before the forward, which SGLang's decode CUDA graphs capture and replay:
  ``ragged_decode.py``); its constructor attaches an aux cache
  to SGLang's request pool (``ReqToTokenPool.attach_aux_cache``), which appends each step's entries on the host
  side before the forward and gives a row's entries back when SGLang releases the row.

The step end (``RaggedKVzapSGLang.on_step_end``) decides for every request of the step at once: one threshold
pass over the prompts that ended, one over the tokens that left the window.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from kvzap_export.errors import ConfigError
from kvzap_export.integrations.host_reads import counted
from kvzap_export.integrations.ragged_shared import SharedRaggedStore
from kvzap_export.integrations.ragged_store import RaggedStore
from kvzap_export.integrations.scoring import check_hidden_states
from kvzap_export.integrations.sglang.api import api, sglang_module
from kvzap_export.integrations.sglang.ragged_decode import ENV as ENV_DECODE
from kvzap_export.integrations.sglang.ragged_decode import (BufferedDecode, DecodeBuffers, decode_kernel,
                                                          graph_fits_hook, write_entries)
from kvzap_export.integrations.sglang.ragged_parts import RaggedParts
from kvzap_export.integrations.sglang.ragged_rows import Step, StoreRows, build_step
from kvzap_export.integrations.sglang.runtime import KVzapSGLang
from kvzap_export.integrations.sglang.server_setup import autotune_hook

log = logging.getLogger(__name__)

BACKEND = "kvzap_ragged"
QUANTILE_MAX = 1 << 24  # the most elements torch.quantile takes


def fraction_threshold(scores: torch.Tensor, fraction: float) -> float | None:
    """The quantile of ``scores`` (flat; NaN: not tested) below which ``fraction`` of them lie; None when every one is
    NaN. Past ``QUANTILE_MAX`` scores (a 64k prompt on Llama-3.1-8B has 16.8M) every k-th one, evenly spaced, stands for
    them (``KVZAP_PRUNED_FRACTION`` is a benchmark setting). One host read."""
    if scores.numel() > QUANTILE_MAX:
        scores = scores[:: -(-scores.numel() // QUANTILE_MAX)]
    tau = torch.nanquantile(scores, fraction)
    return None if bool(tau.isnan()) else float(tau)


class RaggedKVzapSGLang(KVzapSGLang):
    """The runtime of the ragged mode: scores go to the store next to each entry; the step end decides for the
    whole batch in the store. ``parts``: this process's store, budget plan and backend (``ragged_parts.py``)."""

    def __init__(self, *args, pruned_fraction: float | None = None, parts: RaggedParts | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.parts = parts if parts is not None else RaggedParts()
        self.choices: dict[int, str] = {}  # row -> "prefill" | "decoding" for the requests KVzap prunes
        self.pruned_fraction = pruned_fraction  # KVZAP_PRUNED_FRACTION: τ set from the first prompts' scores
        self.decided_on_device = False  # the last step end decided something (its frees may reach the host later)

    @counted("forward")
    def score(self, layer: int, hidden_states: torch.Tensor, forward_batch) -> None:
        """Scores the forward's new tokens into the store, next to their entries (no slot-indexed buffer)."""
        check_hidden_states(hidden_states, f"layer {layer}")
        step = self.parts.forward_step()
        if step is None or step.new_ids.shape[-1] == 0:
            return
        ids = step.new_ids[layer].T  # [T, H]
        scores = self.scorer.score(layer, hidden_states.reshape(-1, hidden_states.shape[-1])[: ids.shape[0]])
        store = self.parts.built_store()
        store.scores.index_copy_(0, ids.reshape(-1), scores.reshape(-1).to(store.scores.dtype))

    def release(self, idx: int) -> None:
        self.choices.pop(idx, None)

    @counted("step_end")
    def on_step_end(self, batch, chunked_req=None) -> None:
        """Prompts that ended this step are decided; decode rows with ``decoding`` test the token that left the
        window. Per request only host bookkeeping (its setting, its phase); the decisions are two batched calls."""
        mode = batch.forward_mode
        extend, decode = mode.is_extend(), mode.is_decode()
        self.forget_finished()
        self.decided_on_device = False
        step = self.parts.take_step()
        if not (extend or decode) or not batch.reqs:
            return
        store = self.parts.built_store()
        shared = isinstance(store, SharedRaggedStore)
        if shared and extend and isinstance(step, Step):  # before any decision: the prompt tokens' full entries
            skip = {r.kv.req_pool_idx for r in batch.reqs if r.skip_radix_cache_insert}  # never in the tree
            size = getattr(batch.token_to_kv_pool_allocator, "size", None)  # SGLang's slot ids: 1 .. size (host)
            store.record(step.rows, step.counts, batch.out_cache_loc, step.new_ids, exclude=skip,
                         slots_below=None if size is None else int(size) + 1)
        prompts, decoding = [], []
        for i, req in enumerate(batch.reqs):
            idx = req.kv.req_pool_idx
            if idx is None:
                continue
            adopted = store.adopted.pop(idx, 0) if shared else 0  # its prompt started with a cached prefix
            if extend and (int(batch.prefix_lens[i]) == 0 or adopted):
                choice = self._choose(req, idx)
                if choice is not None:
                    self.choices[idx] = choice
            elif extend and self.owners.get(idx) is not req:
                # e.g. a streaming session's next turn: its cache was left alone, so it stays alone
                self._bypass(req, idx, f"it extends a cache KVzap did not build (prefix {int(batch.prefix_lens[i])})")
            choice = self.choices.get(idx)
            if choice is None:
                continue
            if extend and req is not chunked_req:  # a prompt's last chunk: the whole prompt is decided now
                prompts.append(idx)
            elif decode and choice == "decoding":
                decoding.append(idx)
        self.decided_on_device = bool(prompts or decoding)  # the plugin reopens admission (plugin._step_end_hook)
        if self.pruned_fraction is not None and prompts:
            self._threshold_from_scores(store, prompts)
        p = self.policy
        store.decide_prefill(prompts, p.threshold, p.window, p.sink)
        store.decide_decode(decoding, p.threshold, p.window, p.sink)

    def _threshold_from_scores(self, store: RaggedStore, prompts: list[int]) -> None:
        """A benchmark setting (``KVZAP_PRUNED_FRACTION``, for models whose scores mean nothing, e.g. dummy weights):
        τ becomes the quantile of the first decided prompts' scores (outside the window) below which that fraction
        lies, once, before their decision; one host read, one log line."""
        tau = fraction_threshold(store.prompt_scores(prompts, self.policy.window), self.pruned_fraction)
        if tau is None:  # prompts within the window: the next ones set it
            return
        self.policy = dataclasses.replace(self.policy, threshold=tau)
        log.warning("KVzap ragged mode: τ = %.4g, set so that %.0f%% of the first prompts' scores lie below it "
                    "(KVZAP_PRUNED_FRACTION, a benchmark setting: the bundle's τ is not used)", tau,
                    100 * self.pruned_fraction)
        self.pruned_fraction = None

    def pool_readings(self, idx: int | None) -> dict:
        store = self.parts.store
        if store is None:
            return {}
        if idx is None:  # read from the free list (radix cache on: entries only its tree holds counted apart)
            shared = isinstance(store, SharedRaggedStore)
            cached = store.soft if shared else 0
            out = {"head_slots_held": store.held - cached, "head_slots_free": store.available,
                   "head_slots_pool": store.capacity, "rows": len(store.logical), "threshold": self.policy.threshold,
                   "decode_graph_replays": store.graph_replays,
                   "table_rows_moved": store.table.relocated + store.table.packs}  # rows that outgrew their room
            if shared:
                out.update(head_slots_cached=cached, cache_reclaims=store.reclaims, cache_nodes_reclaimed=store.reclaimed_nodes,
                           cache_prompts_dropped=store.dropped_prompts, cache_holds=store.held_requests)
            budget = self.parts.plan
            if budget is not None:  # SGLang's KV budget beside what the pool sized within it allocated
                out["kv_budget"] = budget.against(store.nbytes(), store.capacity)
            return out
        return {"row_head_slots": store.row_held(idx)}

    def extra_bytes(self) -> dict:
        """The per-head pool: K, V, scores, row tables, free list (no slot-indexed score buffer in this mode)."""
        store = self.parts.store
        return {} if store is None else {f"ragged_{name}": size for name, size in store.nbytes().items()}

    def decided(self, idx: int) -> dict:
        """What the decisions left in row ``idx``: the lengths of its row table (``pool_readings`` reads the pool's
        free list, a separate count)."""
        store = self.parts.store
        if store is None or idx not in self.choices:
            return {}
        return {"decoding": self.choices[idx] == "decoding", "logical_length": store.logical.get(idx, 0),
                "decided_entries": store.row_held(idx)}


def backend_class(parts: RaggedParts):
    """SGLang's ``torch_native`` backend with K/V in the store and attention per head, one call per layer. Each
    instance reads the store from ``parts`` and enters itself there (the runtime takes the forward's step from it)."""
    base = sglang_module("sglang.srt.layers.attention.torch_native_backend").TorchNativeAttnBackend

    class KVzapRaggedAttnBackend(base):
        def __init__(self, model_runner):
            super().__init__(model_runner)
            allocator = model_runner.token_to_kv_pool_allocator
            try:
                self.store = parts.built_store()
            except ConfigError as exc:
                raise SystemExit(f"kvzap-export: {exc}") from None
            self.parts = parts
            requests = model_runner.req_to_token_pool
            if requests._aux_cache is None:
                requests.attach_aux_cache(StoreRows(self.store, allocator.dense_tokens, requests.req_to_token))
            self.rows = requests._aux_cache
            self.step: Step | BufferedDecode | None = None  # the forward's layout: what its attention reads
            self._untaken: Step | BufferedDecode | None = None  # the same, until the step end takes it
            self.workspace = torch.empty(0, dtype=self.store.k.dtype, device=self.store.device)  # decode key gathers
            try:
                self.decode_kernel = decode_kernel(self.store.device)
            except ConfigError as exc:
                raise SystemExit(f"kvzap-export: {exc}") from None
            self.max_requests = int(requests.size)
            self.group = int(model_runner.model_config.num_attention_heads) // self.store.num_kv_heads  # TP 1 here
            self.decode_buffers: DecodeBuffers | None = None  # SGLang's kernel's step buffers, made at the first need
            self.told_eager = False  # decode_fits_graph's line
            parts.backend = self

        def _lay_out(self, step: "Step | BufferedDecode | None") -> None:
            self.step = self._untaken = step

        def forward_step(self) -> "Step | BufferedDecode | None":
            """The step laid out for the forward running now, until the step end takes it (the scoring hook)."""
            return self._untaken

        def take_step(self) -> "Step | BufferedDecode | None":
            """The step of the forward that just ran, once (the step end); the forward keeps its own ``step``."""
            step, self._untaken = self._untaken, None
            return step

        def _buffers(self, graph_batch: int = 0) -> DecodeBuffers:
            """The decode buffers, made at the first need for SGLang's request rows; their partial results sized for
            ``graph_batch`` requests (the largest captured batch; 0 without graphs: eager steps allocate their own)."""
            if self.decode_buffers is None:
                from kvzap_export.kernels.flattened_step import GPU_SMALL_BATCH_SPLITS, GPU_SPLITS

                # on a GPU 32 splits per row, 64 at small batches (kernels/flattened_step.py); on the CPU the
                # flattened path runs SGLang's kernel in Triton's interpreter (tests only), where each split is a
                # Python loop: 2
                cuda = self.store.device.type == "cuda"
                self.decode_buffers = DecodeBuffers(self.store, max(graph_batch, self.max_requests), self.group,
                                                    self.store.k.dtype, max_kv_splits=GPU_SPLITS if cuda else 2,
                                                    logits_batch=max(graph_batch, 1),
                                                    small_batch_splits=GPU_SMALL_BATCH_SPLITS if cuda else 2)
                log.info("KVzap ragged mode: decode through SGLang's decode kernel, %.1f MB of step buffers for %d "
                         "requests", self.decode_buffers.nbytes() / 2**20, self.decode_buffers.max_batch)
                indices = self.decode_buffers.flat.kv_indices
                built = self.decode_buffers.nbytes() - indices.numel() * indices.element_size()
                budget = self.parts.plan
                planned = budget.fixed.get("decode_buffers", 0) if budget is not None else built
                if built > planned:
                    log.warning("KVzap ragged mode: the decode step buffers take %.1f MB, %.1f MB more than SGLang's KV "
                                "budget set aside for them", built / 2**20, (built - planned) / 2**20)
            return self.decode_buffers

        def decode_fits_graph(self) -> bool:
            """Whether the decode step laid out for the next forward fits the graphs' id buffer (``graph_fits_hook``);
            the first that does not is logged."""
            plan = self.rows.plan
            if plan is None or self.decode_buffers is None or self.decode_buffers.fits_graph(plan[0]):
                return True
            if not self.told_eager:
                self.told_eager = True
                log.warning("KVzap ragged mode: a decode step's rows share more entries than a CUDA graph's id buffer "
                            "holds (requests sharing a cached prefix); such steps run eagerly")
            return False

        # ---- CUDA graphs (decode): SGLang's DecodeCudaGraphRunner calls these ----
        def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
            if self.decode_kernel != "sglang":
                raise SystemExit(f"kvzap-export: KVzap ragged mode captures decode graphs only through SGLang's "
                                 f"decode kernel ({ENV_DECODE}={self.decode_kernel}); add --cuda-graph-backend-decode "
                                 "disabled")
            self._buffers(max_bs)

        def get_cuda_graph_seq_len_fill_value(self):
            return 1

        @counted("forward")
        def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
            """Before a decode graph's capture (a batch of padding) or replay (the step's requests, padded)."""
            mode = forward_batch.forward_mode
            if not mode.is_decode():
                raise SystemExit(f"kvzap-export: KVzap ragged mode runs plain decode in CUDA graphs only, SGLang asked "
                                 f"for {mode.name} (speculative decoding and prefill graphs are not supported: drop "
                                 "--speculative-algorithm, add --cuda-graph-backend-prefill disabled)")
            if not in_capture and self.store.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                # SGLang's metadata glue graph (SGLANG_ENABLE_METADATA_GLUE_GRAPH=1) would freeze this Python layout
                # (the step's slots, new ids and widths) into a graph; refusing makes it fall back to eager preps.
                raise RuntimeError("KVzap ragged mode: the per-step decode layout cannot be captured in a graph")
            buffers = self._buffers()
            if in_capture:
                self._lay_out(buffers.capture_layout(forward_batch.batch_size))
                return
            rows, _, new_ids = self.rows.take_plan([int(n) for n in forward_batch.seq_lens_cpu.tolist()], padded=True)
            self._lay_out(buffers.layout(rows, new_ids, forward_batch.batch_size, graphed=True))
            self.store.graph_replays += 1  # the readings' count of decode steps that replay a CUDA graph

        @counted("forward")
        def init_forward_metadata(self, forward_batch):
            super().init_forward_metadata(forward_batch)
            mode = forward_batch.forward_mode
            if not (mode.is_extend() or mode.is_decode()):
                self._lay_out(None)
                return
            rows, counts, new_ids = self.rows.take_plan([int(n) for n in forward_batch.seq_lens_cpu.tolist()])
            if mode.is_decode() and self.decode_kernel == "sglang":
                self._lay_out(self._buffers().layout(rows, new_ids))
                return
            self._lay_out(build_step(self.store, rows, counts, new_ids, mode.is_extend()))
            if mode.is_decode():
                need = len(rows) * self.store.num_kv_heads * max(self.step.widths, default=0) * self.store.head_dim
                if need > self.workspace.numel():  # one buffer for every layer's key gather (the torch path)
                    self.workspace = torch.empty(int(need * 1.25), dtype=self.store.k.dtype, device=self.store.device)

        @staticmethod
        def _check_save(save_kv_cache, k) -> None:
            if not save_kv_cache or k is None:  # nothing else writes the store: those entries would stay empty
                raise SystemExit("kvzap-export: KVzap's ragged mode needs the attention backend to store K/V; this "
                                 "model writes its KV cache itself (e.g. fused ROCm paths): use KVZAP_MODE=mask")

        def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            """k, v: [T, kv_heads, D] of this forward's tokens -> their entries, one write per layer."""
            write_entries(self.store, self.step.new_ids[layer], k, v)

        @counted("forward")
        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            from kvzap_export.kernels.ragged_attention import causal_extend_attention, prefix_extend_attention

            hq, hk, d, dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim
            self._check_save(save_kv_cache, k)
            q3, k3, v3 = q.reshape(-1, hq, d), k.reshape(-1, hk, d), v.reshape(-1, hk, dv)
            step, lid = self.step, layer.layer_id
            self._write(lid, k3, v3)
            if step.fresh:  # a new prompt is dense: attend over its own K/V
                out = causal_extend_attention(q3, k3.to(q3.dtype), v3.to(q3.dtype), step.counts, layer.scaling,
                                              step.where)
            else:  # entries held before this chunk: gathered (each head's own), then the chunk causally
                held = step.lengths[:, lid].to(torch.int64) - step.count_tensor[:, None]
                prefix = self.store.layer_ids(step.slots, lid, step.prefix_widths[lid]).to(torch.int64)
                out = prefix_extend_attention(q3, k3.to(q3.dtype), v3.to(q3.dtype), step.counts,
                                              self.store.k[prefix].to(q3.dtype), self.store.v[prefix].to(q3.dtype), held,
                                              layer.scaling, heads_agree=step.prefix_agree[lid], where=step.where)
            return out.reshape(-1, hq * dv)

        @counted("forward")
        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            from kvzap_export.kernels.ragged_attention import decode_attention

            hq, hk, d, dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim
            self._check_save(save_kv_cache, k)
            step, lid = self.step, layer.layer_id
            self._write(lid, k.reshape(-1, hk, d), v.reshape(-1, hk, dv))
            if isinstance(step, BufferedDecode):  # SGLang's kernel over the step buffers: fixed ones only (graph-safe)
                q3 = q.reshape(-1, hq, d)
                out = torch.empty(q3.shape[0], hq, dv, dtype=q3.dtype, device=q3.device)
                return self.decode_buffers.attend(lid, q3, layer.scaling, out).reshape(-1, hq * dv)
            ids = self.store.layer_ids(step.slots, lid, step.widths[lid])
            out = decode_attention(q.reshape(-1, hq, d), self.store.k, self.store.v, ids, step.lengths[:, lid],
                                   layer.scaling, self.workspace, groups=step.groups[lid] if step.groups else None)
            return out.reshape(-1, hq * dv)

    return KVzapRaggedAttnBackend


def register(register_hook, kind, one_line) -> RaggedParts:
    """Registers the pool and allocator hooks and the ``kvzap_ragged`` backend in this process (``one_line``: the
    plugin's wrapper that turns a ``KvzapError`` into a one-line exit). Returns the process's ``RaggedParts``, which
    those hooks and the backend fill (the plugin hands it to the runtime)."""
    from kvzap_export.integrations.sglang import ragged_budget, ragged_pool, ragged_radix

    registry = sglang_module("sglang.srt.layers.attention.attention_registry")
    choices = sglang_module("sglang.srt.arg_groups.choices")
    parts = RaggedParts()
    register_hook(api("SRTPlatform.get_kv_pool_cls").target, ragged_pool.pool_class_hook, kind.AROUND)
    register_hook(api("KVCacheConfigurator._build_token_to_kv_pool_allocator").target,
                  one_line(functools.partial(ragged_pool.allocator_hook, parts)), kind.AROUND)
    register_hook(api("KVCacheConfigurator.config_from_budget").target,
                  one_line(functools.partial(ragged_budget.budget_hook, parts)), kind.AROUND)
    register_hook(api("BeamCoordinator.validate_and_init").target, ragged_pool.beam_hook, kind.AROUND)
    register_hook(api("create_tree_cache").target, one_line(ragged_radix.tree_cache_hook), kind.AROUND)
    register_hook(api("alloc_for_extend").target, ragged_radix.extend_prefixes_hook, kind.BEFORE)
    register_hook(api("Scheduler.get_new_batch_prefill").target, ragged_radix.prefill_hold_hook, kind.AROUND)
    register_hook(api("DecodeCudaGraphRunner.can_run_graph").target, functools.partial(graph_fits_hook, parts),
                  kind.AFTER)
    register_hook(api("should_run_flashinfer_autotune").target, autotune_hook, kind.AROUND)
    backend = backend_class(parts)
    registry.register_attention_backend(BACKEND)(lambda runner: backend(runner))
    choices.add_attention_backend_choices([BACKEND])
    return parts
