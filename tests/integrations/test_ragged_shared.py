"""``SharedRaggedStore``: prompts' records shared between rows by reference counts, soft entries, no leak (no engine)."""

from __future__ import annotations

import pytest
import torch

from kvzap_export.integrations.ragged_shared import SharedRaggedStore, take_soft

L, H, D = 2, 2, 4


def make(capacity: int = 400) -> SharedRaggedStore:
    return SharedRaggedStore(capacity, L, H, D, rows=2, width=4, slots=8)


def prefill(store: SharedRaggedStore, row: int, slots: list[int], scores: torch.Tensor | None = None) -> torch.Tensor:
    """A dense prompt of len(slots) tokens on a new row, recorded under the engine slots ``slots``."""
    new = store.append([row], [len(slots)])
    if scores is not None:
        store.scores[new.reshape(-1)] = scores.reshape(-1)
    assert store.record([row], [len(slots)], torch.tensor(slots), new) == len(slots)
    return new


def accounted(store: SharedRaggedStore) -> None:
    """Every entry is exactly one of: free, soft (a record alone holds it), held by rows; the free list is a set."""
    free = store._free[: store.available].to(torch.int64)
    assert free.unique().numel() == free.numel()
    held = store.rowref[: store.capacity] > 0
    soft = store.recorded[: store.capacity] & ~held
    assert not bool(held[free].any()) and not bool(store.recorded[free].any())
    assert int(soft.sum()) == store.soft
    assert store.available + store.soft + int(held.sum()) == store.capacity
    records = store.records  # every record row is either on its free stack or one recorded slot's, once
    used = records.row_of[records.recorded_slots()].to(torch.int64)
    spare = records._free[: int(records.top)].to(torch.int64)
    assert torch.cat([used, spare]).sort().values.tolist() == list(range(records.rows))


def test_a_new_row_adopts_the_full_prefix_another_rows_decisions_pruned():
    store = make()
    scores = torch.full((L, H, 6), 5.0)
    scores[:, :, 1] = -9.0  # token 1 is evicted by a prefill decision (window 2)
    a = prefill(store, 0, [1, 2, 3, 4, 5, 6], scores)
    freed = store.decide_prefill([0], threshold=0.0, window=2)
    assert freed == L * H and store.soft == L * H  # the row let go of token 1's entries: recorded, so soft
    assert store.row_entries(0, 1, 1).tolist() == a[1, 1, [0, 2, 3, 4, 5]].tolist()  # records refer to ids: none moved
    assert store.available == store.capacity - L * H * 6  # ... not back on the free list
    assert store.row_held(0) == L * H * 5
    accounted(store)
    store.adopt(1, torch.tensor([1, 2, 3, 4]))  # a later prompt sharing the first 4 tokens
    for layer in range(L):
        for head in range(H):
            assert store.row_entries(1, layer, head).tolist() == a[layer, head, :4].tolist()  # token 1 included
    assert store.soft == 0 and store.logical[1] == 4 and store.adopted[1] == 4 and store.dense_len[1] == 4
    assert int(store.rowref[a[0, 0, 0]]) == 2
    accounted(store)
    new = store.append([1], [3])  # its own suffix, then its own prompt decision over all 7 tokens
    assert store.record([1], [3], torch.tensor([7, 8, 9]), new) == 3
    store.decide_prefill([1], threshold=0.0, window=2)
    accounted(store)
    store.release(0)
    store.release(1)
    accounted(store)
    assert store.available + store.soft == store.capacity  # at idle only records hold entries
    store.clear_records()
    assert store.available == store.capacity and store.soft == 0
    accounted(store)


def test_an_entry_two_rows_hold_is_freed_once_and_only_after_its_record_ends():
    store = make()
    a = prefill(store, 0, [1, 2, 3])
    store.adopt(1, torch.tensor([1, 2, 3]))
    store.release(0)
    store.release(1)
    assert store.soft == L * H * 3 and store.available == store.capacity - L * H * 3
    store.drop_records(torch.tensor([2, 2]))  # the engine let go of one slot (named twice: it ends once)
    assert store.available == store.capacity - L * H * 2 and store.soft == L * H * 2
    assert not bool(store.recorded[a[:, :, 1].reshape(-1)].any())
    store.drop_records(torch.tensor([1, 3, 99]))  # a slot without a record is ignored
    assert store.available == store.capacity
    accounted(store)


def test_rows_adopting_in_one_call_share_entries_and_count_soft_ones_once():
    """SGLang admits several requests on one cached prefix in one batch: their adoptions are one call (one read of the
    device); an entry both adopt stops being soft once; a row whose prefix holds an unrecorded slot fails the call
    before anything changes."""
    store = make()
    a = prefill(store, 0, [1, 2, 3, 4], torch.full((L, H, 4), -9.0))
    store.decide_prefill([0], threshold=0.0, window=1)
    store.release(0)
    assert store.soft == L * H * 4
    with pytest.raises(RuntimeError, match="row 3 adopts 2 slots"):
        store.adopt_all({2: torch.tensor([1, 2]), 3: torch.tensor([1, 5])})
    assert not store.slot_of and not store.logical and store.soft == L * H * 4  # nothing changed
    store.adopt_all({2: torch.tensor([1, 2, 3]), 3: torch.tensor([1, 2]), 4: torch.tensor([], dtype=torch.int64)})
    assert store.soft == L * H and 4 not in store.logical  # token 4's entries: no row holds them
    assert int(store.rowref[a[0, 0, 0]]) == 2 and int(store.rowref[a[1, 1, 2]]) == 1
    assert store.row_entries(3, 1, 0).tolist() == a[1, 0, :2].tolist()
    accounted(store)
    store.release(2)
    store.release(3)
    assert store.soft == L * H * 4
    accounted(store)


def test_records_end_in_chunks_each_once_and_only_for_slots_inside_the_tables(monkeypatch):
    """A large free ends records a chunk at a time (bounded scratch): a slot named twice across a chunk's edge ends
    once. Slots outside the tables (negative, past them) end nothing: a negative id does not wrap to the last slot."""
    from kvzap_export.integrations import ragged_shared

    monkeypatch.setattr(ragged_shared, "DROP_CHUNK", 2 * L * H)  # 2 slots a chunk
    store = make()
    prefill(store, 0, [1, 2, 3, 4, 5, 6, 7])
    store.release(0)
    assert store.slot_count == 8 and store.soft == L * H * 7
    store.drop_records(torch.tensor([-2, -1, 8, 99]))
    assert store.soft == L * H * 7 and bool(store.records.has(torch.tensor([7])))
    store.drop_records(torch.tensor([3, 2, 2, 5, 2, 3, 1]))  # sorted: 1 2 | 2 2 | 3 3 | 5
    assert store.soft == L * H * 3 and store.records.has(torch.arange(8)).tolist() == [False, False, False, False, True, False, True, True]
    accounted(store)
    store.clear_records()
    assert store.available == store.capacity and store.soft == 0
    accounted(store)


def test_only_dense_rows_get_records_and_a_prefix_must_be_recorded():
    store = make()
    prefill(store, 0, [1, 2, 3, 4])
    store.scores[store.row_entries(0, 0, 0)] = -9.0
    store.decide_prefill([0], threshold=0.0, window=1)
    new = store.append([0], [1])  # a decode token over a pruned row: not a prompt token kvpress would compute
    assert store.record([0], [1], torch.tensor([5]), new) == 0
    new = store.append([2], [2])
    assert store.record([2], [2], torch.tensor([6, 7]), new, exclude={2}) == 0  # never cached by the engine
    with pytest.raises(RuntimeError, match="no record"):
        store.adopt(3, torch.tensor([1, 5]))
    with pytest.raises(Exception, match="already holds"):
        store.adopt(0, torch.tensor([1]))
    accounted(store)


def test_an_allocation_short_of_free_entries_asks_the_engine_to_reclaim_soft_ones():
    store = make(capacity=L * H * 6)
    scores = torch.full((L, H, 4), -9.0)
    prefill(store, 0, [1, 2, 3, 4], scores)
    store.decide_prefill([0], threshold=0.0, window=1)  # 3 of 4 tokens' entries evicted: soft
    assert store.soft == L * H * 3 and store.available == L * H * 2 and store.reclaimable == L * H * 5
    asked = []

    def reclaim(short: int) -> None:  # what the engine's tree does: give up records, least recently used first
        asked.append(short)
        store.drop_records(torch.tensor([1, 2]))

    store.reclaimer = reclaim
    store.append([1], [3])
    assert asked == [L * H] and store.available == L * H and store.soft == L * H
    accounted(store)


def test_soft_entries_an_admitted_request_will_adopt_are_not_room():
    store = make()
    scores = torch.full((L, H, 4), -9.0)
    prefill(store, 0, [1, 2, 3, 4], scores)
    store.decide_prefill([0], threshold=0.0, window=1)
    store.release(0)
    assert store.reclaimable == store.capacity  # at idle: free, or soft (a cached prompt)
    store.set_aside({7: torch.tensor([1, 2, 3, 4])})  # a request admitted on it (7: the engine's node)
    assert store.pending == {7: L * H * 4} and store.reclaimable == store.capacity - L * H * 4
    store.adopt(1, torch.tensor([1, 2, 3, 4]))
    store.clear_aside()  # what the engine does once the batch's rows adopted their prefixes
    assert store.reclaimable == store.capacity - L * H * 4 and store.soft == 0
    accounted(store)


def test_entries_a_row_lets_go_of_between_an_admission_and_its_adoption_stay_set_aside():
    """SGLang's priority preemption: a formation admits a request on a cached prefix that a running request alone
    holds (nothing soft to set aside), then preempts that running request. Its entries turn soft, yet the admitted
    request will adopt them: they must not become room."""
    store = make()
    prefill(store, 0, [1, 2, 3, 4], torch.full((L, H, 4), 5.0))
    store.decide_prefill([0], threshold=0.0, window=1)  # every token kept: the running row holds them all
    store.anchored(0, 4)
    room = store.reclaimable
    store.set_aside({7: torch.tensor([1, 2, 3, 4]), 8: torch.tensor([5])})  # node 8: a slot with no record
    assert store.pending == {7: 0, 8: 0}
    store.release(0)  # preempted
    assert store.soft == L * H * 4 and store.pending == {7: L * H * 4, 8: 0}
    assert store.reclaimable == room
    store.adopt(1, torch.tensor([1, 2, 3, 4]))
    store.clear_aside()
    assert store.reclaimable == room and store.soft == 0 and not store.pending_slots
    accounted(store)
    store.set_aside({7: torch.tensor([1, 2, 3, 4])})
    store.unset_aside(7)  # an admission that ended without an adoption
    assert not store.pending and not store.pending_slots


def test_records_the_prefix_cache_has_not_taken_yet_can_be_dropped_and_are_not_cached_then():
    """Under an overlap scheduler SGLang inserts a prompt into its tree a step after the step end recorded it, and admits
    requests in between, counting the prompt's soft entries as room: until the tree takes them (``anchored``) only
    ``drop_unanchored`` can free them, and the row's recorded length falls back so the tree will not cache them."""
    store = make()
    scores = torch.full((L, H, 6), 5.0)
    scores[:, :, 1] = -9.0
    prefill(store, 0, [1, 2, 3, 4, 5, 6], scores)
    store.decide_prefill([0], threshold=0.0, window=2)
    prefill(store, 1, [7, 8, 9])  # recorded, nothing evicted yet: dropping its records would free nothing
    assert store.soft == L * H and sorted(store.unanchored) == [0, 1] and store.dense_len[0] == 6
    free = store.available
    assert store.drop_unanchored(1) == L * H and store.dropped_prompts == 1  # token 1's: only the record held them
    assert store.soft == 0 and store.available == free + L * H and store.dense_len[0] == 0
    assert not bool(store.records.has(torch.arange(1, 7)).any()) and bool(store.records.has(torch.arange(7, 10)).all())
    assert list(store.unanchored) == [1] and store.dense_len[1] == 3  # kept: the tree may still cache it
    assert store.drop_unanchored() == 0 and list(store.unanchored) == [1]
    accounted(store)

    store = make()  # a prompt in two chunks, then the tree takes its first 4 tokens, then all
    first = store.append([0], [3])
    store.record([0], [3], torch.tensor([1, 2, 3]), first)
    second = store.append([0], [3])
    store.record([0], [3], torch.tensor([4, 5, 6]), second)
    at, slots = store.unanchored[0]
    assert at == 0 and slots.tolist() == [1, 2, 3, 4, 5, 6]
    store.anchored(0, 4)
    at, slots = store.unanchored[0]
    assert at == 4 and slots.tolist() == [5, 6]
    store.anchored(0, 6)
    assert not store.unanchored and store.drop_unanchored() == 0 and store.dense_len[0] == 6
    store.release(0)
    accounted(store)


def test_a_reclaim_takes_groups_that_free_something_in_its_order_until_it_has_enough():
    soft = [0, 5, 0, 3, 2]
    assert take_soft(soft, range(5), None) == ([1, 3, 4], 10)  # None: every group that frees anything
    assert take_soft(soft, range(5), 6) == ([1, 3], 8)  # stops once enough: the last pick may overshoot
    assert take_soft(soft, [4, 3, 1], 4) == ([4, 3], 5)  # the caller's order (least recently used, most soft first)
    assert take_soft(soft, range(5), 0) == ([], 0) and take_soft([], [], None) == ([], 0)
