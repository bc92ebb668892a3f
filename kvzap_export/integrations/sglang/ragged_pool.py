"""Ragged mode's KV pool in SGLang: a placeholder pool with no dense K/V, an allocator counted in the per-head store's
free entries, and the store itself (this process's one ``RaggedStore``, handed to ``RaggedParts``), built through
SGLang's extension points (``ragged.py``'s docstring lists them; ``ragged.register`` installs these hooks)."""

from __future__ import annotations

import logging

import torch

from kvzap_export.errors import ConfigError
from kvzap_export.integrations.host_reads import counted
from kvzap_export.integrations.ragged_shared import SharedRaggedStore
from kvzap_export.integrations.ragged_store import RaggedStore
from kvzap_export.integrations.rank_room import RankRoom
from kvzap_export.integrations.sglang.api import sglang_module
from kvzap_export.integrations.sglang.ragged_budget import SLOT_INDEX
from kvzap_export.integrations.sglang.ragged_parts import RaggedParts
from kvzap_export.integrations.sglang.ragged_radix import shares_prefixes
from kvzap_export.integrations.sglang.server_setup import tp_group

log = logging.getLogger(__name__)

INITIAL_WIDTH = 256  # row-table columns to start with (grown by a quarter on demand, up to the longest row held)
INITIAL_ROWS = 16  # row tables to start with (grown by a quarter on demand, up to the requests held at once)


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
        """Logical slot ids as SGLang's allocator hands them out, grown on demand; availability counted in the
        store's free entries, in dense tokens."""

        store: RaggedStore | None = None
        entries_per_token = 1
        tree = None  # KVzap's radix tree (ragged_radix.py) when SGLang's radix cache is on

        def logical_available(self) -> int:
            """Free logical slot ids (SGLang's own free list)."""
            return super().available_size()

        def local_room(self) -> tuple[int, int]:
            """This rank's (free, room) in dense tokens: the store's free entries, and with KVzap's tree also its soft
            ones less those set aside (``SharedRaggedStore.reclaimable``), each // entries per token."""
            free = self.store.available // self.entries_per_token
            return free, (self.store.reclaimable // self.entries_per_token if self.tree is not None else free)

        def available_size(self):
            if self.store is None:
                return super().available_size()
            ranks = self.store.ranks
            # tensor parallelism: the figure every rank shares (rank_room.py); one rank: this store's own
            room = ranks.room(0) if ranks is not None and ranks.shared else self.local_room()[1]
            if self.tree is None:
                return room
            # free + soft entries, less the tokens SGLang counts as evictable (whole nodes: their entries are all
            # soft), so that available + evictable is the room an eviction and a reclaim can make (ragged_radix.py)
            return room - self.tree.evictable_size()

        def exact(self) -> None:
            """Exact figures: waits for the store's pending snapshots; under tensor parallelism then agrees with the
            other ranks (blocking; every rank calls this at the same point, from a shared figure or at idle)."""
            self.store.exact()
            ranks = self.store.ranks
            if ranks is not None and ranks.shared and ranks.dirty:
                ranks.agree(*self.local_room())

        def step_ended(self) -> None:
            """After the step end's decisions: starts the ranks' next agreement (tensor parallelism; rank_room.py)."""
            ranks = self.store.ranks if self.store is not None else None
            if ranks is not None and ranks.shared:
                ranks.start(*self.local_room())

        # On a GPU ``available_size()`` is a lower bound until the snapshot of the last decisions and releases has
        # arrived (ragged_mirror.py). SGLang decides on it without waiting where being short only delays (admission);
        # where a short figure makes it act (evict cached prefixes, retract running requests one by one) it first
        # learns the exact figure, waiting for the device: a slow path only.
        def _exact_if_short(self, num_tokens: int) -> None:
            if self.store is not None and self.available_size() < num_tokens:
                self.exact()

        def evict_to_free_tokens(self, tree_cache, num_tokens: int):
            self._exact_if_short(num_tokens)
            return super().evict_to_free_tokens(tree_cache, num_tokens)

        def check_decode_capacity(self, *, num_tokens: int, tree_cache, requests=None, spec_algorithm=None) -> bool:
            self._exact_if_short(num_tokens)
            return super().check_decode_capacity(num_tokens=num_tokens, tree_cache=tree_cache, requests=requests,
                                                 spec_algorithm=spec_algorithm)

        def free(self, free_index):
            if self.store is not None and self.store.ranks is not None:
                self.store.ranks.touched()
            if isinstance(self.store, SharedRaggedStore) and self.free_group is None:
                self._end_records(free_index)
            super().free(free_index)

        @counted("release")
        def _end_records(self, free_index) -> None:
            self.store.drop_records(free_index)  # the slots' records end with SGLang's hold on them

        def clear(self):
            super().clear()
            if isinstance(self.store, SharedRaggedStore):
                self.store.clear_records()

        def alloc(self, need_size: int):
            if self.store is not None and self.store.ranks is not None:
                self.store.ranks.charge(need_size)  # the same on every rank: the ranks' shared figure falls by it
            short = need_size - len(self.free_pages)
            if short > 0 and self.store is not None:
                # Slot ids carry no K/V here: more of them cost 8 bytes each. The store's free entries are what
                # admission checked (available_size), so the logical count is never the limit.
                grow = max(short, self.size // 2)
                extra = torch.arange(self.size + 1, self.size + grow + 1, dtype=torch.int64, device=self.device)
                self.free_pages = torch.cat([self.free_pages, extra])
                self.size += grow
            return super().alloc(need_size)

    return KVzapRaggedAllocator


def tp_cpu_group():
    """SGLang's tensor-parallel CPU (gloo) group when it spans more than one rank, else None."""
    group = tp_group()
    return group.cpu_group if group is not None and group.world_size > 1 else None


def pool_class_hook(original_fn, platform, *args, kind=None, **kwargs):
    if kind == "mha":
        return placeholder_pool_class()
    return original_fn(platform, *args, kind=kind, **kwargs)


def beam_hook(original_fn, coordinator, req, *args, **kwargs):
    """Beam requests are refused (a 400 for that request): beams copy and remap each other's slot rows, which
    per-head rows do not follow. SGLang aborts the request with the string this returns."""
    return ("KVzap's ragged mode does not serve beam search: beams share and remap their KV rows, which the "
            "per-head store does not follow; use KVZAP_MODE=mask or evict for beam requests")


def allocator_hook(parts: RaggedParts, original_fn, configurator, *args, **kwargs):
    """AROUND ``KVCacheConfigurator._build_token_to_kv_pool_allocator`` (bound to ``parts`` by ``ragged.register``):
    the store, sized from SGLang's token count, and the allocator that owns it; ``parts.store`` is set."""
    pool = kwargs.get("token_to_kv_pool")
    if pool is None or not type(pool).__name__ == "KVzapRaggedPlaceholderPool":
        raise ConfigError("KVzap ragged mode: SGLang built a KV pool other than the ragged placeholder (this model's "
                          "attention is not plain MHA/GQA, or another plugin replaced the pool); use KVZAP_MODE=mask")
    tokens = int(kwargs["sizes"].max_total_num_tokens)
    layers, heads = int(pool.layer_num), int(pool.head_num)
    shared = {"slots": tokens + 1} if shares_prefixes() else {}
    store = (SharedRaggedStore if shared else RaggedStore)(
        tokens * layers * heads, layers, heads, int(pool.head_dim), int(pool.v_head_dim), rows=INITIAL_ROWS,
        width=INITIAL_WIDTH, dtype=pool.store_dtype, device=pool.device, **shared)
    allocator = allocator_class()(tokens, dtype=pool.store_dtype, device=pool.device, kvcache=pool, need_sort=False)
    allocator.store, allocator.entries_per_token = store, layers * heads
    allocator.dense_tokens = tokens
    group = tp_cpu_group()
    if group is not None:  # one blocking agreement now: the ranks' pools are sized alike, checked rather than assumed
        store.ranks = RankRoom(group, start=tokens)
        store.ranks.agree(tokens, tokens)
    pool.mem_usage = sum(store.nbytes().values()) / (1 << 30)
    parts.store = store
    budget = parts.plan
    if budget is None:  # SGLang sized the pool without its budget path (a caller's fixed pool config)
        log.info("KVzap ragged mode: %d one-head K/V entries (%d tokens x %d layers x %d KV heads), %.3f GB with "
                 "scores and row tables; SGLang's pool was not sized from a KV budget",
                 store.capacity, tokens, layers, heads, pool.mem_usage)
    else:
        # SGLang checks at idle that the allocator's free count equals its max_total_num_tokens, so the store holds
        # the dense count of entries; its bookkeeping was taken off the budget SGLang sized them with
        # at least the first tables (tiny pools)
        # int32 columns, allocated now, for SGLang's request rows
        store.reserve_table(budget.split(store.capacity)["row_tables"] // 4, int(kwargs["req_to_token_pool"].size))
        if isinstance(store, SharedRaggedStore):  # the records' index: SLOT_INDEX logical slots per dense token
            store.records.reserve = SLOT_INDEX * tokens
        log.info("KVzap ragged mode: %d one-head K/V entries (%d tokens x %d layers x %d KV heads) take %s",
                 store.capacity, tokens, layers, heads, budget.describe(store.capacity))
    return allocator
