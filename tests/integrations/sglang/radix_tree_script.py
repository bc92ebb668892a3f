"""Run by test_engine_streams.py with the SGLang environment's Python: KVzap's radix tree (``ragged_radix.py``, a subclass of
SGLang 0.5.23's own ``RadixCache``) over a ``SharedRaggedStore`` and the ragged allocator, driven step by step as the
scheduler drives them (insert, match, lock, adopt, decide, reclaim, evict, unlock). Prints one JSON object of what it
read; the test asserts on it. Not a test module itself (it needs SGLang)."""

from __future__ import annotations

import json
from array import array

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from kvzap_export.integrations.ragged_shared import SharedRaggedStore
from kvzap_export.integrations.sglang.ragged_pool import allocator_class
from kvzap_export.integrations.sglang.ragged_radix import radix_cache_class

L, H, D, TOKENS = 2, 2, 4, 40
PER = L * H


def key(ids):
    return RadixKey(token_ids=array("q", ids))


def pool():
    """A store, SGLang's allocator over it and KVzap's tree, wired as the ragged mode wires them."""
    store = SharedRaggedStore(TOKENS * PER, L, H, D, rows=2, width=8, slots=TOKENS + 1)
    allocator = allocator_class()(TOKENS, dtype=torch.float32, device="cpu", kvcache=None, need_sort=False)
    allocator.store, allocator.entries_per_token, allocator.dense_tokens = store, PER, TOKENS
    tree = radix_cache_class()(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator,
                                               page_size=1))
    return store, allocator, tree


def main() -> dict:
    store, allocator, tree = pool()
    out = {"idle_start": allocator.available_size() + tree.evictable_size()}

    # request A: a 10-token prompt, prefilled densely, recorded, decided (tokens 2..5 evicted), cached, locked
    prompt_a = list(range(100, 110))
    slots_a = allocator.alloc(10)
    ids_a = store.append([0], [10])
    store.k[ids_a.reshape(-1)] = torch.arange(ids_a.numel(), dtype=torch.float32)[:, None]  # known K values
    store.scores[ids_a.reshape(-1)] = 5.0
    store.scores[ids_a[:, :, 2:6].reshape(-1)] = -9.0
    store.record([0], [10], slots_a, ids_a)
    store.decide_prefill([0], threshold=0.0, window=2)
    tree.insert(InsertParams(key=key(prompt_a), value=slots_a.clone()))
    lock_a = tree.lock(tree.match_prefix(MatchPrefixParams(key=key(prompt_a))).last_device_node)
    store.clear_aside()  # what A's allocation does (its own admission lock set nothing aside it did not use)
    out["soft_after_a"] = store.soft

    # request B: A's first 8 tokens and 4 of its own; admission locks the match, its row adopts the full prefix
    prompt_b = prompt_a[:8] + [7, 7, 7, 7]
    match = tree.match_prefix(MatchPrefixParams(key=key(prompt_b)))
    before_lock = allocator.available_size() + tree.evictable_size()
    # SGLang 0.5.23's PrefillAdder: a temporary lock while it checks the budget, the committing lock taken inside it,
    # the temporary one ended first: the committing lock alone must keep the soft entries B will adopt set aside
    check = tree.lock(match.last_device_node)
    lock_b = tree.lock(match.last_device_node)
    tree.unlock(check)
    out["room_lost_at_admission"] = before_lock - (allocator.available_size() + tree.evictable_size())
    probe = tree.lock(match.last_device_node)  # a second admission of the same prefix sets nothing more aside
    out["room_lost_at_second_admission"] = before_lock - (allocator.available_size() + tree.evictable_size())
    tree.unlock(probe)
    out["b_prefix"] = int(match.device_prefix_len)
    prefix_slots = tree.path_device_indices(match.last_device_node)[:8]
    store.adopt(1, prefix_slots)
    store.clear_aside()
    out["b_holds_a_evicted_tokens"] = all(
        store.row_entries(1, layer, head).tolist()[:8] == ids_a[layer, head, :8].tolist()
        for layer in range(L) for head in range(H))
    ids_b = store.append([1], [4])
    slots_b = allocator.alloc(4)  # B's own tokens: not inserted in this script, so freed at its end (release_kv_cache)
    store.record([1], [4], slots_b, ids_b)
    store.scores[ids_b.reshape(-1)] = 5.0
    store.scores[ids_a[:, :, 6:8].reshape(-1)] = -9.0  # B evicts tokens 2..7 (A kept 6, 7)
    store.decide_prefill([1], threshold=0.0, window=2)
    held_by_rows = torch.cat([store.row_entries(r, layer, head) for r in (0, 1) for layer in range(L)
                              for head in range(H)])
    k_before = store.k[held_by_rows].clone()

    # the store runs short: the reclaim takes back the soft entries of the locked, shared prefix (tokens 2..5,
    # evicted by both A and B) while both requests still read it
    store.reclaimer(PER)
    out["reclaimed_nodes"] = store.reclaimed_nodes
    free = set(store._free[: store.available].tolist())
    out["row_entries_freed_early"] = len(free & set(held_by_rows.tolist()))
    new_ids = store.append([2], [int(store.available // PER)])  # every free entry handed out and overwritten
    store.k[new_ids.reshape(-1)] = -1.0
    out["row_k_unchanged"] = bool(torch.equal(store.k[held_by_rows], k_before))
    store.release(2)
    out["c_prefix_after_break"] = int(tree.match_prefix(MatchPrefixParams(key=key(prompt_b))).device_prefix_len)

    # A finishes, then B: the broken node is cut once no request locks it; SGLang's eviction empties the rest
    store.release(0)
    tree.unlock(lock_a)
    allocator.free(slots_b)  # SGLang's order (release_kv_cache): the slots, then the row
    store.release(1)
    tree.unlock(lock_b)
    out["idle_after"] = allocator.available_size() + tree.evictable_size()
    out["cached_entries"], out["tree_tokens"] = store.soft, tree.evictable_size()
    tree.evict(EvictParams(num_tokens=TOKENS))
    out["free_after_evict"], out["capacity"] = store.available, store.capacity
    out["tokens"] = TOKENS
    out["unanchored"] = not_in_the_tree_yet()
    out["preempted"] = preempted_while_admitting()
    return out


def room(allocator, tree) -> int:
    """What SGLang's admission reads as room, in tokens."""
    return allocator.available_size() + tree.evictable_size()


def preempted_while_admitting() -> dict:
    """SGLang's priority preemption inside one formation: R (row 0) runs on a cached 10-token prompt it alone holds
    (every token kept), S is admitted on its first 8 tokens (nothing soft to set aside yet), then the formation
    preempts R (``release_req``: R's lock ends, then its row goes). R's 8 tokens that S will adopt must not become room;
    the 2 that S does not take become evictable, so room grows by exactly 2 tokens."""
    store, allocator, tree = pool()
    prompt = list(range(200, 210))
    slots = allocator.alloc(10)
    ids = store.append([0], [10])
    store.scores[ids.reshape(-1)] = 5.0
    store.record([0], [10], slots, ids)
    store.decide_prefill([0], threshold=0.0, window=2)
    tree.insert(InsertParams(key=key(prompt), value=slots.clone()))
    lock_r = tree.lock(tree.match_prefix(MatchPrefixParams(key=key(prompt))).last_device_node)
    store.clear_aside()  # R's own allocation
    before = room(allocator, tree)
    match = tree.match_prefix(MatchPrefixParams(key=key(prompt[:8] + [9, 9])))
    check = tree.lock(match.last_device_node)  # S's admission, in SGLang 0.5.23's lock order
    lock_s = tree.lock(match.last_device_node)
    tree.unlock(check)
    out = {"room_lost_at_admission": before - room(allocator, tree), "s_prefix": int(match.device_prefix_len)}
    tree.unlock(lock_r)  # R preempted (release_kv_cache): its lock, then its row; its slots stay (the tree holds them)
    store.release(0)
    out["room_gained_at_preemption"] = room(allocator, tree) - before
    store.adopt(1, tree.path_device_indices(match.last_device_node)[:8])  # S's allocation
    store.clear_aside()
    out["room_gained_after_adoption"] = room(allocator, tree) - before
    store.release(1)
    tree.unlock(lock_s)
    tree.evict(EvictParams(num_tokens=TOKENS))
    out["free_at_end"], out["capacity"] = store.available, store.capacity
    return out


def not_in_the_tree_yet() -> dict:
    """The reclaim's last stage, as the overlap scheduler needs it: prompts E (row 0) and F (row 1) prefilled,
    recorded and decided by a step end, not inserted into the tree yet (SGLang does that a step later, after it
    prepared the next batch), and nothing in the tree to evict or break. A 21-token prompt then needs one token's
    entries more than are free: its allocation's reclaim ends the records of F (the prompt with more soft entries)
    only, and frees no entry a row holds."""
    store, allocator, tree = pool()
    slots = []
    for row, evicted in ((0, [3]), (1, [2, 3, 4, 5])):  # E evicts 1 token, F 4
        slots.append(allocator.alloc(10))
        ids = store.append([row], [10])
        store.scores[ids.reshape(-1)] = 5.0
        store.scores[ids[:, :, evicted].reshape(-1)] = -9.0
        store.record([row], [10], slots[-1], ids)
        store.decide_prefill([row], threshold=0.0, window=2)
    held = torch.cat([store.row_entries(r, layer, head) for r in (0, 1) for layer in range(L) for head in range(H)])
    out = {"soft_before": store.soft, "rows_before": sorted(store.unanchored), "evictable": tree.evictable_size(),
           "short": 21 * PER - store.available}
    free_before = store.available
    store.append([2], [21])  # not recorded: only its row holds these entries
    free = set(store._free[: store.available].tolist())
    out.update(freed=store.available + 21 * PER - free_before, dropped_prompts=store.dropped_prompts,
               rows_after=sorted(store.unanchored), dense_len=[store.dense_len[0], store.dense_len[1]],
               soft_after=store.soft, row_entries_freed_early=len(free & set(held.tolist())),
               reclaimed_nodes=store.reclaimed_nodes)
    store.release(2)
    for row, row_slots in zip((0, 1), slots):  # both end uncached, in SGLang's order: the slots, then the row
        allocator.free(row_slots)
        store.release(row)
    out["free_at_end"], out["capacity"] = store.available, store.capacity
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
