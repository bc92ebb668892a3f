"""Holding back requests an in-flight prefill will let hit (``ragged_radix.requests_to_hold``, ``prefill_hold_hook``).

SGLang is not imported here: its requests and scheduler are modelled by the fields the hook reads (each listed in
``api.py`` and checked against the 0.5.23 source by ``test_api.py``). The real overlap loop runs the hook in the engine
test (``test_engine.py``: every repeated prompt of a burst takes its prefix from the cache).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvzap_export.integrations.sglang import ragged_radix
from kvzap_export.integrations.sglang.ragged_radix import common_prefix, prefill_hold_hook, requests_to_hold

SYSTEM = list(range(1000, 1100))  # a 100-token shared prefix


def waiting(rid: str, ids: list[int]):
    return SimpleNamespace(rid=rid, origin_input_ids=ids)


def in_flight(ids: list[int], prefix_len: int = 0, extend_end: int | None = None):
    return SimpleNamespace(full_untruncated_fill_ids=ids, prefix_len=prefix_len,
                           extend_end=len(ids) if extend_end is None else extend_end)


@pytest.mark.parametrize("a, b, n", [([1, 2, 3], [1, 2, 4], 2), ([1, 2], [1, 2, 3], 2), ([], [1], 0), ([5], [6], 0),
                                     ([7, 8], [7, 8], 2)])
def test_common_prefix_counts_the_leading_ids_both_share(a, b, n):
    assert common_prefix(a, b) == n


def test_a_request_sharing_an_uncached_prefix_with_an_in_flight_prefill_is_held():
    a = waiting("a", SYSTEM + [1, 2, 3])
    b = waiting("b", list(range(5000, 5200)))  # shares nothing
    c = waiting("c", SYSTEM[:20] + [9] * 50)  # shares 20 tokens: under the 32-token minimum
    q = in_flight(SYSTEM + [4, 5, 6])
    assert requests_to_hold([a, b, c], [q]) == [a]


def test_what_the_tree_already_held_at_the_in_flight_requests_admission_is_no_reason_to_hold():
    a = waiting("a", SYSTEM + [1, 2, 3])
    assert requests_to_hold([a], [in_flight(SYSTEM + [4, 5, 6], prefix_len=90)]) == []  # 10 more tokens only
    assert requests_to_hold([a], [in_flight(SYSTEM + [4, 5, 6], prefix_len=60)]) == [a]  # 40 more


def test_only_the_tokens_the_in_flight_extend_computed_count():
    """A chunk in flight puts ``[0, extend_end)`` into the tree, not the rest of its prompt."""
    a = waiting("a", SYSTEM + [1, 2, 3])
    assert requests_to_hold([a], [in_flight(SYSTEM + [4], extend_end=20)]) == []
    assert requests_to_hold([a], [in_flight(SYSTEM + [4], extend_end=40)]) == [a]


def test_a_request_can_match_all_but_its_last_token_and_is_held_once():
    same = SYSTEM[:40]
    a = waiting("a", same)  # SGLang matches at most 39 of its 40 tokens: 39 >= 32
    assert requests_to_hold([a], [in_flight(same)]) == [a]
    assert requests_to_hold([a], [in_flight(same)], held_before={"a"}) == []
    short = waiting("s", SYSTEM[:32])  # at most 31 matched: under the minimum
    assert requests_to_hold([short], [in_flight(SYSTEM[:32])]) == []


class Tree:
    """Stands in for KVzap's tree class (the hook acts only with it)."""


def scheduler(queue, batches, overlap=True, tree=None):
    return SimpleNamespace(enable_overlap=overlap, tree_cache=tree if tree is not None else Tree(),
                           waiting_queue=list(queue), result_queue=list(batches))


def extend_batch(*reqs, extend=True):
    return SimpleNamespace(reqs=list(reqs), forward_mode=SimpleNamespace(is_extend=lambda: extend)), None


@pytest.fixture(autouse=True)
def tree_class(monkeypatch):
    monkeypatch.setattr(ragged_radix, "radix_cache_class", lambda: Tree)
    ragged_radix._HELD.clear()
    yield
    ragged_radix._HELD.clear()


def test_the_hook_hides_held_requests_from_one_formation_and_puts_them_back_in_place():
    a, b, c = waiting("a", SYSTEM + [1]), waiting("b", [7] * 50), waiting("c", SYSTEM + [2])
    late = waiting("late", [8] * 50)
    sched = scheduler([a, b, c], [extend_batch(in_flight(SYSTEM + [3]))])
    seen = []

    def formation(s, running_batch):
        seen.append(list(s.waiting_queue))
        s.waiting_queue = [r for r in s.waiting_queue if r is not b] + [late]  # admits b, queues a preempted one
        return "plan"

    assert prefill_hold_hook(formation, sched, "running") == "plan"
    assert seen == [[b]]
    assert sched.waiting_queue == [a, c, late]
    # the next formation (the in-flight prefill still unprocessed): each request is held once only
    assert prefill_hold_hook(formation, sched, "running") == "plan"
    assert seen[-1] == [a, c, late]


@pytest.mark.parametrize("case", ["overlap off", "another tree", "decode in flight", "nothing in flight"])
def test_the_hook_leaves_the_queue_alone_without_an_in_flight_prefill_under_overlap_and_kvzaps_tree(case):
    a = waiting("a", SYSTEM + [1])
    batch = extend_batch(in_flight(SYSTEM + [3]), extend=case != "decode in flight")
    sched = scheduler([a], [] if case == "nothing in flight" else [batch], overlap=case != "overlap off",
                      tree=object() if case == "another tree" else None)
    seen = []
    prefill_hold_hook(lambda s, running_batch: seen.append(list(s.waiting_queue)), sched, "running")
    assert seen == [[a]] and sched.waiting_queue == [a]
