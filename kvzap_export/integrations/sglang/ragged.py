"""Ragged mode (``KVZAP_MODE=ragged``): every (request, layer, KV head) owns its own KV entries in SGLang.

Design: docs/ragged-kv.md. In short: K/V live in a ``RaggedStore`` (one-head entries, one pool for all
layers, heads and requests, ``N · layers · kv_heads`` entries for SGLang's ``N``-token budget); SGLang keeps
its logical view (slot ids, ``req_to_token``, ``seq_lens``, positions), but its slots carry no K/V. Attach
points, all SGLang extension points:

- AROUND ``SRTPlatform.get_kv_pool_cls``: SGLang's pool becomes ``NoOpMHATokenToKVPool``'s placeholder
  subclass (no dense K/V buffers are allocated);
- AROUND ``KVCacheConfigurator._build_token_to_kv_pool_allocator``: SGLang's token allocator is a subclass
  with ``OVERCOMMIT · N`` logical slots whose ``available_size()`` is
  ``min(free slots, free entries // (layers · kv_heads))`` (admission control in dense-token units); it
  owns the store;
- ``register_attention_backend("kvzap_ragged")``: writes new K/V into the store and attends per head
  (``kernels.ragged_attention``: torch on the CPU, the Triton decode kernel on GPUs); its constructor
  attaches an aux cache to SGLang's request pool (``ReqToTokenPool.attach_aux_cache``), which appends entries
  for new tokens before each forward and gives a row's entries back when SGLang releases the row.

The step end (shared with the other modes) compacts each request's rows with kvpress's per-head decisions.
"""

from __future__ import annotations

import logging

import torch

from kvzap_export.errors import ConfigError
from kvzap_export.integrations.ragged_store import RaggedStore
from kvzap_export.integrations.sglang.api import api, sglang_module
from kvzap_export.integrations.sglang.runtime import KVzapSGLang

log = logging.getLogger(__name__)

BACKEND = "kvzap_ragged"
OVERCOMMIT = 2  # logical slot ids per dense token of the budget: how far pruning can raise the token count
_STORE: RaggedStore | None = None  # this process's store, made with SGLang's allocator


def current_store() -> RaggedStore:
    if _STORE is None:
        raise ConfigError("the ragged KV store does not exist in this process: SGLang's pool was not built through "
                          "the ragged mode's hooks (is KVZAP_MODE=ragged set in every SGLang process?)")
    return _STORE


class RaggedKVzapSGLang(KVzapSGLang):
    """The runtime of the ragged mode: decisions compact the request's rows in the store."""

    def apply(self, batch, i, req, idx, row, decision, state) -> None:
        store = current_store()
        store.compact(idx, decision.indices, decision.counts)
        if not torch.equal(store.row(idx).lengths.to(state.counts.device), state.counts):
            raise RuntimeError(f"ragged store rows of request row {idx} diverged from KVzap's state")  # our bug

    def pool_readings(self, idx: int | None) -> dict:
        store = _STORE
        if store is None:
            return {}
        if idx is None:  # read from the free list
            return {"head_slots_held": store.held, "head_slots_free": store.available, "head_slots_pool": store.capacity,
                    "rows": len(store.rows)}
        table = store.rows.get(idx)
        return {"row_head_slots": table.held() if table is not None else 0}


class StoreRows:
    """SGLang's aux-cache protocol for ``ReqToTokenPool``: grows rows before each forward, frees released rows."""

    def __init__(self, store: RaggedStore, dense_capacity: int):
        self.store, self.dense_capacity = store, dense_capacity

    def alloc_to_lengths(self, *, req_pool_indices_cpu, target_seq_lens_cpu) -> None:
        for row, target in zip(req_pool_indices_cpu.tolist(), target_seq_lens_cpu.tolist()):
            table = self.store.rows.get(int(row))
            new = int(target) - (table.logical if table is not None else 0)
            if new > 0:
                self.store.append(int(row), new)

    def free(self, row) -> None:
        self.store.release(int(row))

    def clear(self) -> None:
        self.store.clear()

    def reset_allocator(self) -> None:
        pass


def placeholder_pool_class():
    """SGLang's ``NoOpMHATokenToKVPool`` (placeholder buffers, no dense K/V) reporting the store's bytes."""
    base = sglang_module("sglang.srt.mem_cache.memory_pool").NoOpMHATokenToKVPool

    class KVzapRaggedPlaceholderPool(base):
        def _finalize_allocation_log(self, num_tokens: int):
            self.mem_usage = 0.0  # set to the store's size when the allocator builds it
            log.info("KVzap ragged mode: SGLang's dense K/V buffers are not allocated (%d logical tokens)", num_tokens)

    return KVzapRaggedPlaceholderPool


def allocator_class():
    base = sglang_module("sglang.srt.mem_cache.allocator.token").TokenToKVPoolAllocator

    class KVzapRaggedAllocator(base):
        """Logical slot ids as SGLang's allocator hands them out; availability counted in the store's entries."""

        store: RaggedStore | None = None
        entries_per_token = 1

        def available_size(self):
            slots = super().available_size()
            if self.store is None:
                return slots
            return min(slots, self.store.available // self.entries_per_token)

    return KVzapRaggedAllocator


def _pool_class_hook(original_fn, platform, *args, kind=None, **kwargs):
    if kind == "mha":
        return placeholder_pool_class()
    return original_fn(platform, *args, kind=kind, **kwargs)


def _allocator_hook(original_fn, configurator, *args, **kwargs):
    global _STORE
    pool = kwargs.get("token_to_kv_pool")
    if pool is None or not type(pool).__name__ == "KVzapRaggedPlaceholderPool":
        raise ConfigError("KVzap ragged mode: SGLang built a KV pool other than the ragged placeholder (this model's "
                          "attention is not plain MHA/GQA, or another plugin replaced the pool); use KVZAP_MODE=mask")
    tokens = int(kwargs["sizes"].max_total_num_tokens)
    layers, heads = int(pool.layer_num), int(pool.head_num)
    store = RaggedStore(tokens * layers * heads, layers, heads, int(pool.head_dim), int(pool.v_head_dim),
                        dtype=pool.store_dtype, device=pool.device)
    allocator = allocator_class()(tokens * OVERCOMMIT, dtype=pool.store_dtype, device=pool.device, kvcache=pool,
                                  need_sort=False)
    allocator.store, allocator.entries_per_token = store, layers * heads
    allocator.dense_tokens = tokens
    pool.mem_usage = store.nbytes() / (1 << 30)
    _STORE = store
    log.info("KVzap ragged mode: %d one-head K/V entries (%d tokens x %d layers x %d KV heads, %.2f GB), "
             "%d logical slots", store.capacity, tokens, layers, heads, pool.mem_usage, allocator.size)
    return allocator


def backend_class():
    """SGLang's ``torch_native`` backend with K/V in the store and attention per head."""
    base = sglang_module("sglang.srt.layers.attention.torch_native_backend").TorchNativeAttnBackend

    class KVzapRaggedAttnBackend(base):
        def __init__(self, model_runner):
            super().__init__(model_runner)
            allocator = model_runner.token_to_kv_pool_allocator
            self.store = current_store()
            requests = model_runner.req_to_token_pool
            if requests._aux_cache is None:
                requests.attach_aux_cache(StoreRows(self.store, allocator.dense_tokens))

        def _write(self, row: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            """k, v: [n, kv_heads, D] of this forward's tokens of one request -> the last n entries of each head."""
            ids = self.store.last(row, layer, k.shape[0]).T.reshape(-1)  # [n * H] in (token, head) order
            self.store.k[ids] = k.reshape(-1, k.shape[-1]).to(self.store.k.dtype)
            self.store.v[ids] = v.reshape(-1, v.shape[-1]).to(self.store.v.dtype)

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            from kvzap_export.kernels.ragged_attention import ragged_extend_attention

            hq, hk, d, dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim
            q3 = q.reshape(-1, hq, d)
            out = q.new_empty(q3.shape[0], hq, dv)
            rows = forward_batch.req_pool_indices.tolist()
            start = 0
            for row, prefix, n in zip(rows, forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu):
                if save_kv_cache and k is not None:
                    self._write(row, layer.layer_id, k.reshape(-1, hk, d)[start: start + n],
                                v.reshape(-1, hk, dv)[start: start + n])
                ids, positions, lengths = self.store.gather(row, layer.layer_id)
                out[start: start + n] = ragged_extend_attention(
                    q3[start: start + n], self.store.k, self.store.v, ids, positions, lengths,
                    torch.arange(prefix, prefix + n, device=ids.device), layer.scaling)
                start += n
            return out.reshape(-1, hq * dv)

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            from kvzap_export.kernels.ragged_attention import decode_attention

            hq, hk, d, dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim
            rows = forward_batch.req_pool_indices.tolist()
            if save_kv_cache and k is not None:
                k3, v3 = k.reshape(-1, hk, d), v.reshape(-1, hk, dv)
                for b, row in enumerate(rows):
                    self._write(row, layer.layer_id, k3[b: b + 1], v3[b: b + 1])
            views = [self.store.gather(row, layer.layer_id) for row in rows]
            width = max(1, max(int(view[2].max()) for view in views))
            ids = torch.full((len(rows), hk, width), -1, dtype=torch.int64, device=self.store.k.device)
            lengths = torch.stack([view[2] for view in views])
            for b, view in enumerate(views):
                ids[b, :, : view[0].shape[-1]] = view[0]
            out = decode_attention(q.reshape(-1, hq, d), self.store.k, self.store.v, ids, lengths, layer.scaling)
            return out.reshape(-1, hq * dv)

    return KVzapRaggedAttnBackend


def register(register_hook, kind) -> None:
    """Registers the pool and allocator hooks and the ``kvzap_ragged`` backend in this process."""
    registry = sglang_module("sglang.srt.layers.attention.attention_registry")
    choices = sglang_module("sglang.srt.arg_groups.choices")
    register_hook(api("SRTPlatform.get_kv_pool_cls").target, _pool_class_hook, kind.AROUND)
    register_hook(api("KVCacheConfigurator._build_token_to_kv_pool_allocator").target, _allocator_hook, kind.AROUND)
    backend = backend_class()
    registry.register_attention_backend(BACKEND)(lambda runner: backend(runner))
    choices.add_attention_backend_choices([BACKEND])
