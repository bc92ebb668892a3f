"""Holding back requests an in-flight prefill will let hit (``ragged_radix.requests_to_hold``, ``prefill_hold_hook``).

SGLang is not imported here: its requests and scheduler are modelled by the fields the hook reads (each listed in
``api.py`` and checked against the 0.5.23 source by ``test_api.py``). The real overlap loop runs the hook in the engine
test (``test_engine.py``: every repeated prompt of a burst takes its prefix from the cache).
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest

from kvzap_export.integrations.sglang import ragged_radix
from kvzap_export.integrations.sglang.ragged_radix import prefill_hold_hook, requests_to_hold

SYSTEM = list(range(1000, 1100))  # a 100-token shared prefix


def waiting(rid: str, ids: list[int], extra_key=None, logprob_start: int | None = None):
    def max_prefix(input_len):  # SGLang's: all but the last token, or up to the first token whose logprob is asked
        return min(input_len - 1, logprob_start) if logprob_start is not None else input_len - 1

    return SimpleNamespace(rid=rid, origin_input_ids=array("q", ids), output_ids=array("q"), extra_key=extra_key,
                           cache_salt=None, _compute_max_prefix_len=max_prefix)


def in_flight(ids: list[int], prefix_len: int = 0, extend_end: int | None = None, skip=False, extra_key=None):
    return SimpleNamespace(full_untruncated_fill_ids=array("q", ids), prefix_len=prefix_len,
                           extend_end=len(ids) if extend_end is None else extend_end, skip_radix_cache_insert=skip,
                           extra_key=extra_key, cache_salt=None)


def test_a_request_sharing_an_uncached_prefix_with_an_in_flight_prefill_is_held():
    a = waiting("a", SYSTEM + [1, 2, 3])
    b = waiting("b", list(range(5000, 5200)))  # shares nothing
    c = waiting("c", SYSTEM[:20] + [9] * 50)  # shares 20 tokens: under the 32-token minimum
    d = waiting("d", SYSTEM[:31] + [9] + SYSTEM[32:])  # differs at token 31
    q = in_flight(SYSTEM + [4, 5, 6])
    assert requests_to_hold([a, b, c, d], [q]) == [a]


def test_what_the_tree_already_held_at_the_in_flight_requests_admission_is_no_reason_to_hold():
    a = waiting("a", SYSTEM + [1, 2, 3])
    assert requests_to_hold([a], [in_flight(SYSTEM + [4, 5, 6], prefix_len=90)]) == []  # 13 more tokens only
    assert requests_to_hold([a], [in_flight(SYSTEM + [4, 5, 6], prefix_len=60)]) == [a]  # 43 more


def test_only_the_tokens_the_in_flight_extend_computed_and_will_insert_count():
    """A chunk in flight puts ``[0, extend_end)`` into the tree, not the rest of its prompt; a request that skips the
    tree puts nothing."""
    a = waiting("a", SYSTEM + [1, 2, 3])
    assert requests_to_hold([a], [in_flight(SYSTEM + [4], extend_end=20)]) == []
    assert requests_to_hold([a], [in_flight(SYSTEM + [4], extend_end=40)]) == [a]
    assert requests_to_hold([a], [in_flight(SYSTEM + [4], skip=True)]) == []


def test_a_request_is_held_only_for_what_sglang_would_match_under_its_key_and_once():
    same = SYSTEM[:40]
    a = waiting("a", same)  # SGLang matches at most 39 of its 40 tokens: 39 >= 32
    assert requests_to_hold([a], [in_flight(same)]) == [a]
    assert requests_to_hold([a], [in_flight(same)], held_before={"a"}) == []
    short = waiting("s", SYSTEM[:32])  # at most 31 matched: under the minimum
    assert requests_to_hold([short], [in_flight(SYSTEM[:32])]) == []
    logprobs = waiting("l", SYSTEM, logprob_start=10)  # asks for logprobs from token 10: SGLang matches 10 at most
    assert requests_to_hold([logprobs], [in_flight(SYSTEM)]) == []
    other_key = waiting("k", SYSTEM, extra_key="lora-1")  # another radix key: the in-flight prompt is no match
    assert requests_to_hold([other_key], [in_flight(SYSTEM)]) == []
    assert requests_to_hold([other_key], [in_flight(SYSTEM, extra_key="lora-1")]) == [other_key]


class Tree:
    """Stands in for KVzap's tree class (the hook acts only with it)."""

    def __init__(self):
        self.store = SimpleNamespace(held_requests=0)


def scheduler(queue, batches, overlap=True, tree=None, max_queued=None):
    return SimpleNamespace(enable_overlap=overlap, tree_cache=tree if tree is not None else Tree(),
                           waiting_queue=list(queue), result_queue=list(batches), max_queued_requests=max_queued,
                           chunked_req=None)


def extend_batch(*reqs, extend=True):
    return SimpleNamespace(reqs=list(reqs), forward_mode=SimpleNamespace(is_extend=lambda: extend)), None


RUNNING = SimpleNamespace(batch_is_full=False)


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

    assert prefill_hold_hook(formation, sched, RUNNING) == "plan"
    assert seen == [[b]]
    assert sched.waiting_queue == [a, c, late] and sched.tree_cache.store.held_requests == 2
    # the next formation (the in-flight prefill still unprocessed): each request is held once only
    assert prefill_hold_hook(formation, sched, RUNNING) == "plan"
    assert seen[-1] == [a, c, late] and sched.tree_cache.store.held_requests == 2


def test_a_request_that_left_the_queue_can_be_held_again_when_it_returns():
    """A retracted request comes back to the queue under its rid: its earlier hold is forgotten once it left."""
    a, b = waiting("a", SYSTEM + [1]), waiting("b", [7] * 50)
    sched = scheduler([a], [extend_batch(in_flight(SYSTEM + [3]))])
    prefill_hold_hook(lambda s, running_batch: None, sched, RUNNING)
    sched.waiting_queue = [b]  # a was admitted
    prefill_hold_hook(lambda s, running_batch: None, sched, RUNNING)
    sched.waiting_queue = [a]  # and retracted
    seen = []
    prefill_hold_hook(lambda s, running_batch: seen.append(list(s.waiting_queue)), sched, RUNNING)
    assert seen == [[]] and sched.tree_cache.store.held_requests == 2


def test_the_queue_is_put_back_when_the_formation_raises():
    a, b = waiting("a", SYSTEM + [1]), waiting("b", [7] * 50)
    sched = scheduler([a, b], [extend_batch(in_flight(SYSTEM + [3]))])

    def formation(s, running_batch):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        prefill_hold_hook(formation, sched, RUNNING)
    assert sched.waiting_queue == [a, b]


@pytest.mark.parametrize("case", ["overlap off", "another tree", "decode in flight", "nothing in flight",
                                  "queue limit", "batch full"])
def test_the_hook_leaves_the_queue_alone_unless_an_in_flight_prefill_can_help_an_admission(case):
    a = waiting("a", SYSTEM + [1])
    batch = extend_batch(in_flight(SYSTEM + [3]), extend=case != "decode in flight")
    sched = scheduler([a], [] if case == "nothing in flight" else [batch], overlap=case != "overlap off",
                      tree=object() if case == "another tree" else None, max_queued=64 if case == "queue limit" else None)
    running = SimpleNamespace(batch_is_full=case == "batch full")
    seen = []
    prefill_hold_hook(lambda s, running_batch: seen.append(list(s.waiting_queue)), sched, running)
    assert seen == [[a]] and sched.waiting_queue == [a] and not ragged_radix._HELD
