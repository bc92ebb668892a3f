"""Ragged mode with SGLang's radix cache on: a prefix's per-head entries computed once, shared exactly.

The exactness argument and the accounting are in docs/ragged-kv.md ("Radix cache in ragged mode"). In short:

- the tree is SGLang's own ``RadixCache`` (``mem_cache/radix_cache.py``: token ids -> logical slot ids, LRU
  eviction, lock counts), subclassed; in ragged mode it replaces the default tree (AROUND hook on
  ``create_tree_cache``) when the radix cache is on and nothing else was asked for;
- each slot the tree holds keeps its token's full entries, one per (layer, KV head), as a dense prefill computed them
  (``SharedRaggedStore`` records); a new request adopts the records of its matched prefix into its own row and decides
  on them as kvpress would on its own prompt; only prompt tokens enter the tree (``checkpoint`` stops at the tokens
  a dense prefill recorded: a decoded answer is computed again when a later prompt contains it);
- entries a record holds and no row does (every reader evicted them) are *soft*: counted as room
  (``available_size()``: ``(free + soft) // (layers · kv_heads) - evictable``, so at idle SGLang's check
  ``available + evictable == max_total_num_tokens`` holds) and taken back when an allocation finds too few free
  entries (``reclaim``): first SGLang's own eviction of unlocked nodes, then the records of locked nodes, least
  recently used first; such a node is *broken*: a match stops before it, and it is cut from the tree (with its
  subtree) once no request locks it;
- under SGLang's overlap scheduler, a batch formation stops before the first waiting request that shares a prefix
  with a prefill still in flight (not yet in the tree), so that it hits at the next formation instead of computing
  the prefix again (AROUND ``Scheduler.get_new_batch_prefill``, ``prefill_hold_hook``).
"""

from __future__ import annotations

import logging
import time
from array import array

import torch

from kvzap_export.integrations.ragged_shared import SharedRaggedStore, leading, take_soft
from kvzap_export.integrations.sglang.api import sglang_module

log = logging.getLogger(__name__)

# Settings that ask SGLang for another tree or for what only its unified tree implements: with any of them the
# AROUND hook leaves SGLang's choice (and its own checks) alone, and the launch check refuses it in one line.
OTHER_TREES = ("radix_cache_backend", "enable_hierarchical_cache", "enable_lmcache", "enable_flexkv",
               "enable_unified_cache_external_linker", "enable_session_radix_cache")


def shares_prefixes() -> bool:
    """Whether this SGLang process runs its radix cache with KVzap's tree (radix on, no other tree asked for)."""
    context = sglang_module("sglang.srt.runtime_context")
    memory = context.get_memory()
    return not (memory.disable_radix_cache or any(getattr(memory, name) for name in OTHER_TREES)
                or memory.radix_eviction_policy == "tlru" or context.get_serving().enable_streaming_session)


def radix_cache_class():
    """KVzap's tree class over SGLang's ``RadixCache`` (built at each call: SGLang builds one tree per process)."""
    base = sglang_module("sglang.srt.mem_cache.radix_cache").RadixCache
    evict_params = sglang_module("sglang.srt.mem_cache.base_prefix_cache").EvictParams

    class KVzapRaggedRadixCache(base):
        """SGLang's radix tree over a ``SharedRaggedStore`` (module docstring)."""

        def __init__(self, params):
            self._broken: set = set()  # nodes whose records were reclaimed (reset() runs inside super().__init__)
            self._in_checkpoint = False
            self._lock_paths: dict[int, list] = {}  # admission lock -> its path's nodes (since pending's last clear)
            self._admitted: dict = {}  # node -> admission locks on it (since pending's last clear)
            # rids of waiting requests held back once already (``prefill_hold_hook``: once per stay in the queue)
            self.held_rids: set = set()
            super().__init__(params)
            allocator = params.token_to_kv_pool_allocator
            store = getattr(allocator, "store", None)
            if not isinstance(store, SharedRaggedStore):
                raise RuntimeError("KVzap's radix tree needs the ragged mode's shared store (the allocator hook did "
                                   "not build one)")
            self.store, self.entries_per_token = store, allocator.entries_per_token
            allocator.tree = self
            store.reclaimer = self.reclaim

        def reset(self):
            super().reset()
            self._broken.clear()
            self._lock_paths.clear()
            self._admitted.clear()

        # ---- matching: stop before a node whose records were reclaimed ----
        def _match_prefix_helper(self, node, key):
            now = time.monotonic()
            node.last_access_time = now
            value = []
            while len(key) > 0:
                child = node.children.get(key.child_key(self.page_size))
                if child is None or (child in self._broken and not self._in_checkpoint):
                    break
                child.last_access_time = now
                common = child.key.match(key, page_size=self.page_size)
                if common < len(child.key):  # the match ends inside this node: split it there (SGLang does the same)
                    child = self._split_node(child.key, child, common)
                    value.append(child.value)
                    node = child
                    break
                value.append(child.value)
                node, key = child, key[common:]
            return value, node

        def _split_node(self, key, child, split_len):
            head = super()._split_node(key, child, split_len)
            if child in self._broken:
                self._broken.add(head)
            return head

        # ---- inserting: prompt tokens a dense prefill recorded, nothing past them ----
        def checkpoint(self, req, *, up_to: int):
            row = req.kv.req_pool_idx
            recorded = max(self.store.dense_len.get(row, 0), int(req.kv.cache_protected_len))
            self._in_checkpoint = True  # its re-match must walk the path the insert made, broken nodes included
            try:
                super().checkpoint(req, up_to=min(int(up_to), recorded))
            finally:
                self._in_checkpoint = False
            self.store.anchored(row, int(req.kv.cache_protected_len))  # what the tree now holds of the row
            self._cut_unlocked()

        def lock(self, node):
            """A lock outside a checkpoint is an admission's (SGLang's PrefillAdder): the request will adopt the
            path's entries, so their soft ones stop being room until the adoption (``SharedRaggedStore.pending``,
            by node), each node's once however many admission locks hold it (adopting makes them held once; SGLang too
            moves a node out of its evictable count at its first lock only). They stay set aside until the last of
            those locks ends: SGLang 0.5.23's adder takes its committing lock inside the temporary one it checks the
            budget under, and ends the temporary one first. One read of the device per lock with new nodes."""
            held = super().lock(node)
            if self._in_checkpoint or node is self.root_node:
                return held
            admitted = self._admissions()
            path, n = [], node
            while n is not self.root_node:
                path.append(n)
                n = n.parent
            self.store.set_aside({id(n): n.value for n in path if n not in admitted})
            for n in path:
                admitted[n] = admitted.get(n, 0) + 1
            self._lock_paths[id(held)] = path
            return held

        def unlock(self, lock):
            if lock is not None:
                admitted = self._admissions()
                for n in self._lock_paths.pop(id(lock), ()):
                    admitted[n] -= 1
                    if admitted[n] == 0:  # no admission lock left on it: its soft entries are room again
                        del admitted[n]
                        self.store.unset_aside(id(n))
            super().unlock(lock)
            if not self._in_checkpoint:
                self._cut_unlocked()

        def _admissions(self) -> dict:
            """node -> admission locks on it; emptied (with the locks' paths) once the store has cleared ``pending``
            (the allocation that adopts what the admissions set aside: ``ragged_rows.StoreRows.alloc_to_lengths``)."""
            admitted = self._admitted
            if admitted and id(next(iter(admitted))) not in self.store.pending:
                admitted.clear()
                self._lock_paths.clear()
            return admitted

        # ---- SGLang's checks read these ----
        def full_evictable_size(self):
            return self.evictable_size_

        def full_protected_size(self):
            return self.protected_size_

        # ---- memory ----
        def _nodes(self) -> list:
            out, stack = [], list(self.root_node.children.values())
            while stack:
                node = stack.pop()
                out.append(node)
                stack.extend(node.children.values())
            return out

        def reclaim(self, short: int, extra: int = 0) -> None:
            """Frees at least ``short`` entries for an allocation that found too few free (``available_size()``
            counted them as room): unlocked nodes through SGLang's eviction first, then the records of locked nodes,
            least recently used first (those nodes become broken), then the records of prompts not in the tree yet
            (under the overlap scheduler: ``SharedRaggedStore.drop_unanchored``). ``extra``: entries more to free by
            SGLang's eviction alone, where unlocked nodes remain (tensor parallelism's headroom)."""
            store, per_token = self.store, self.entries_per_token
            store.reclaims += 1
            target = store.available + short
            allocator = self.token_to_kv_pool_allocator
            # tensor parallelism: the ranks share this tree, so each step below acts the same on every rank (the
            # ``short`` asked is the most any rank needs; a step is skipped only when no rank needs it)
            ranks = store.ranks if store.ranks is not None and store.ranks.shared else None

            def done() -> bool:
                store.exact()  # records end on the device alone (drop_records): learn what they freed (a slow path)
                met = store.available >= target
                return met if ranks is None else ranks.most(int(not met)) == 0

            if self.evictable_size_ > 0:
                # the evicted slots' records released at once, in one group; if a group is already open (not at SGLang
                # 0.5.23's allocation sites) its slots wait for its end, their records do not
                ours = allocator.free_group is None
                if ours:
                    allocator.free_group_begin()
                try:
                    self.evict(evict_params(num_tokens=-(-(short + extra) // per_token)))
                finally:
                    if ours:
                        allocator.free_group_end()
                if not ours and allocator.free_group:
                    store.drop_records(torch.cat(allocator.free_group))
            if done():
                return
            locked = sorted((n for n in self._nodes() if n.lock_ref > 0 and n not in self._broken),
                            key=lambda n: n.last_access_time)
            if locked:  # one read of the device for all of them, one release of the chosen nodes' records
                soft = store.soft_per_group([n.value for n in locked])
                if ranks is None:
                    picked, gained = take_soft(soft, range(len(locked)), target - store.available)
                else:  # the same least recently used nodes on every rank, as many as the rank that needs most
                    picked = list(range(ranks.most(leading(soft, range(len(locked)), target - store.available))))
                    gained = sum(soft[i] for i in picked)
                chosen = [locked[i] for i in picked]
                store.drop_records(torch.cat([n.value for n in chosen]) if chosen else locked[0].value[:0])
                self._broken.update(chosen)
                store.reclaimed_nodes += len(chosen)
                log.info("KVzap ragged mode: took back %d soft entries from %d running prompts' cached nodes", gained,
                         len(chosen))
            if store.unanchored and not done():
                # under the overlap scheduler: prompts recorded a step ago, which SGLang has not inserted into the tree
                # yet (it processes a step's result after it prepares the next batch); they will not be cached
                gained = store.drop_unanchored(target - store.available)
                log.info("KVzap ragged mode: took back %d soft entries of running prompts not yet in the tree", gained)
            store.exact()
            if store.available < target:
                raise RuntimeError(f"ragged KV store: {target - store.available} entries short after reclaiming every "
                                   "soft entry (the accounting let through more than the store holds: our bug)")

        def _cut_unlocked(self) -> None:
            """Cuts broken nodes no request locks (with their subtrees, unlocked too) out of the tree: their slots go
            back to SGLang's allocator, their entries no row holds to the store."""
            gone = set()
            for node in [n for n in self._broken if n.lock_ref == 0]:
                self._broken.discard(node)
                if node in gone or node.parent.children.get(node.key.child_key(self.page_size)) is not node:
                    continue  # already cut with an ancestor, or evicted by SGLang
                subtree, stack = [], [node]
                while stack:
                    n = stack.pop()
                    subtree.append(n)
                    gone.add(n)
                    stack.extend(n.children.values())
                for n in subtree:
                    self.token_to_kv_pool_allocator.free(n.value)
                    self.evictable_size_ -= len(n.key)
                    self.evictable_leaves.discard(n)
                    self._broken.discard(n)
                    self.kv_events.record_remove(n)
                parent = node.parent
                del parent.children[node.key.child_key(self.page_size)]
                self._update_leaf_status(parent)

    return KVzapRaggedRadixCache


def tree_cache_hook(original_fn, ctx, *args, **kwargs):
    """AROUND ``create_tree_cache``: KVzap's tree when the radix cache is on and no other tree was asked for."""
    if ctx.disable_radix_cache or not shares_prefixes():  # SGLang turns it off for some models by itself
        return original_fn(ctx, *args, **kwargs)
    return radix_cache_class()(ctx.params)


# A waiting request is held back only when a prefill in flight will put at least this many more of its prompt's leading
# tokens into the tree: the number SGLang's cache-aware policies use by default to deprioritize a waiting request that
# shares a prefix with another (``IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD``, ``schedule_policy.py``). Not tuned.
HOLD_MIN_TOKENS = 32


def _leading(ids, n: int) -> bytes:
    """The first ``n`` ids as bytes of int64 (SGLang keeps them as ``array('q')``): one slice and one hash to compare."""
    head = ids[:n]
    return (head if isinstance(head, array) and head.typecode == "q" else array("q", head)).tobytes()


def first_to_hold(waiting, in_flight, held_before=frozenset(), min_tokens: int = HOLD_MIN_TOKENS) -> int | None:
    """The position in ``waiting`` of the first request worth holding back until the in-flight prefills are in the
    tree, or None.

    ``in_flight``: the requests of extend batches whose results SGLang has not processed (under the overlap scheduler,
    the batch launched last). Processing one inserts its tokens ``[0, extend_end)`` (``checkpoint_kv_cache``; none
    when it skips the tree); at its admission the tree held its first ``prefix_len``. A waiting request qualifies when
    its first ``prefix_len + min_tokens`` tokens are that request's, under the same radix key (``extra_key``,
    ``cache_salt``), and SGLang could match that many of its tokens (``_compute_max_prefix_len``): the tree will then
    hold at least ``min_tokens`` more of its prefix than it held at the in-flight request's admission (it may have
    gained some of them since, from a result processed after that admission: such a hold was not needed).
    ``held_before``: rids that never qualify again."""
    groups: dict[tuple, set[bytes]] = {}
    for q in in_flight:
        end, cached = int(q.extend_end or 0), int(q.prefix_len)
        if end - cached >= min_tokens and not q.skip_radix_cache_insert:
            n = cached + min_tokens
            groups.setdefault((n, q.extra_key, q.cache_salt), set()).add(_leading(q.full_untruncated_fill_ids, n))
    if not groups:
        return None
    for i, r in enumerate(waiting):
        if r.rid in held_before:
            continue
        prompt = r.origin_input_ids
        matchable = min(r._compute_max_prefix_len(len(prompt) + len(r.output_ids)), len(prompt))
        if any(n <= matchable and key == r.extra_key and salt == r.cache_salt and _leading(prompt, n) in ids
               for (n, key, salt), ids in groups.items()):
            return i
    return None


def prefill_hold_hook(original_fn, scheduler, running_batch, *args, **kwargs):
    """AROUND ``Scheduler.get_new_batch_prefill``, with KVzap's tree under the overlap scheduler.

    SGLang's overlap loop forms batch N+1 before it processes batch N's result, and a prompt enters the radix tree only
    when its result is processed: a request admitted into N+1 misses the prompts of N it shares a prefix with (a shared
    system prompt arriving in a burst is computed twice). When ``first_to_hold`` finds such a request, this formation
    sees only the requests ahead of it in the queue (so none behind it is admitted before it); the rest is put back
    after whatever the formation left of them, in its order and before any request the call queued (a preempted
    one). SGLang processes N before the next formation, where the held request may be admitted and hit.
    What a request computes and decides does not change. Inside the call SGLang's code sees the shorter queue (its
    prefill statistics, the adder's queue length, the pending-token count). Nothing is held where the hold would not
    keep the queue's order or SGLang would admit nothing: with ``--max-queued-requests`` (its check counts the queue),
    with priority preemption (it may admit past a full batch), while grammars are compiling (SGLang queues the ready
    ones inside the call, after the visible part), and when the running batch is full. Only the first
    ``max_running_requests - running`` waiting requests are looked at: no formation admits more. ``cache_holds``
    counts a hold even when the formation stops earlier for another reason (its token budget)."""
    def formation():
        return original_fn(scheduler, running_batch, *args, **kwargs)

    held = getattr(scheduler.tree_cache, "held_rids", None)  # KVzap's tree (the only one that holds requests back)
    if not getattr(scheduler, "enable_overlap", False) or held is None:
        return formation()
    waiting = scheduler.waiting_queue
    if held:
        held.intersection_update(r.rid for r in waiting)
    room = scheduler.max_running_requests - len(running_batch.reqs)
    if (scheduler.max_queued_requests is not None or scheduler.enable_priority_preemption or not scheduler.result_queue
            or room <= 0 or (running_batch.batch_is_full and not running_batch.is_empty())  # SGLang admits none
            or scheduler.grammar_manager.has_waiting_grammars()):
        return formation()
    in_flight = [q for batch, _ in scheduler.result_queue if batch.forward_mode.is_extend() for q in batch.reqs]
    at = first_to_hold(waiting[:room], in_flight, held)
    if at is None:
        return formation()
    held.add(waiting[at].rid)
    scheduler.tree_cache.store.held_requests += 1
    hidden = waiting[at:]
    scheduler.waiting_queue = waiting[:at]
    try:
        return formation()
    finally:
        seen = {id(r) for r in waiting}
        rest = scheduler.waiting_queue
        scheduler.waiting_queue = ([r for r in rest if id(r) in seen] + hidden
                                   + [r for r in rest if id(r) not in seen])


def extend_prefixes_hook(batch, *args, **kwargs) -> None:
    """BEFORE SGLang's ``alloc_for_extend``: the batch's prefix lengths (the radix cache's matches), for the rows the
    store lays out in the same call (``ragged_rows.StoreRows.alloc_to_lengths`` adopts them)."""
    rows = batch.req_to_token_pool._aux_cache
    if hasattr(rows, "prefix_lens"):
        rows.prefix_lens = [int(p) for p in batch.prefix_lens]
