"""Holding back a request an in-flight prefill will let hit (``ragged_radix.first_to_hold``, ``prefill_hold_hook``).

SGLang is not imported here: its requests and scheduler are modelled by the fields the hook reads (each listed in
``api.py`` and checked against the 0.5.23 source by ``test_api.py``). The real overlap loop runs the hook in the engine
test (``test_engine_streams.py``: every repeated prompt of a burst takes its prefix from the cache, and the holds are counted).
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest

from kvzap_export.integrations.sglang.ragged_radix import first_to_hold, prefill_hold_hook

SYSTEM = list(range(1000, 1100))  # a 100-token shared prefix


def waiting(rid: str, ids: list[int], extra_key=None, cache_salt=None, logprob_start: int | None = None):
    def max_prefix(input_len):  # SGLang's: all but the last token, or up to the first token whose logprob is asked
        return min(input_len - 1, logprob_start) if logprob_start is not None else input_len - 1

    return SimpleNamespace(rid=rid, origin_input_ids=array("q", ids), output_ids=array("q"), extra_key=extra_key,
                           cache_salt=cache_salt, _compute_max_prefix_len=max_prefix)


def in_flight(ids: list[int], prefix_len: int = 0, extend_end: int | None = None, skip=False, extra_key=None,
              cache_salt=None):
    return SimpleNamespace(full_untruncated_fill_ids=array("q", ids), prefix_len=prefix_len,
                           extend_end=len(ids) if extend_end is None else extend_end, skip_radix_cache_insert=skip,
                           extra_key=extra_key, cache_salt=cache_salt)


def test_the_first_request_sharing_an_uncached_prefix_with_an_in_flight_prefill_is_found():
    b = waiting("b", list(range(5000, 5200)))  # shares nothing
    c = waiting("c", SYSTEM[:20] + [9] * 50)  # shares 20 tokens: under the 32-token minimum
    d = waiting("d", SYSTEM[:31] + [9] + SYSTEM[32:])  # differs at token 31
    a = waiting("a", SYSTEM + [1, 2, 3])
    e = waiting("e", SYSTEM + [7])
    q = in_flight(SYSTEM + [4, 5, 6])
    assert first_to_hold([b, c, d, a, e], [q]) == 3
    assert first_to_hold([b, c, d], [q]) is None


def test_it_counts_only_tokens_beyond_what_the_tree_held_at_the_in_flight_requests_admission():
    a = waiting("a", SYSTEM + [1, 2, 3])
    assert first_to_hold([a], [in_flight(SYSTEM + [4, 5, 6], prefix_len=90)]) is None  # 13 more tokens in flight
    assert first_to_hold([a], [in_flight(SYSTEM + [4, 5, 6], prefix_len=60)]) == 0  # 43 more
    # 43 more in flight, but this request shares only 20 of them
    assert first_to_hold([waiting("b", SYSTEM[:80] + [5] * 30)], [in_flight(SYSTEM + [4, 5, 6], prefix_len=60)]) is None


def test_only_the_tokens_the_in_flight_extend_computed_and_will_insert_count():
    """A chunk in flight puts ``[0, extend_end)`` into the tree, not the rest of its prompt; a request that skips the
    tree puts nothing."""
    a = waiting("a", SYSTEM + [1, 2, 3])
    assert first_to_hold([a], [in_flight(SYSTEM + [4], extend_end=20)]) is None
    assert first_to_hold([a], [in_flight(SYSTEM + [4], extend_end=40)]) == 0
    assert first_to_hold([a], [in_flight(SYSTEM + [4], skip=True)]) is None


def test_a_request_qualifies_only_for_what_sglang_would_match_under_its_key_and_once():
    same = SYSTEM[:40]
    a = waiting("a", same)  # SGLang matches at most 39 of its 40 tokens: 39 >= 32
    assert first_to_hold([a], [in_flight(same)]) == 0
    assert first_to_hold([a], [in_flight(same)], held_before={"a"}) is None
    short = waiting("s", SYSTEM[:32])  # at most 31 matched: under the minimum
    assert first_to_hold([short], [in_flight(SYSTEM[:32])]) is None
    logprobs = waiting("l", SYSTEM, logprob_start=10)  # asks for logprobs from token 10: SGLang matches 10 at most
    assert first_to_hold([logprobs], [in_flight(SYSTEM)]) is None
    lora = waiting("k", SYSTEM, extra_key="lora-1")  # another radix key: the in-flight prompt is no match
    assert first_to_hold([lora], [in_flight(SYSTEM)]) is None
    assert first_to_hold([lora], [in_flight(SYSTEM, extra_key="lora-1")]) == 0
    salted = waiting("t", SYSTEM, cache_salt="user-7")
    assert first_to_hold([salted], [in_flight(SYSTEM)]) is None
    assert first_to_hold([salted], [in_flight(SYSTEM, cache_salt="user-7")]) == 0


class Tree:
    """Stands in for KVzap's tree (the hook acts only with a tree that holds requests back: ``held_rids``)."""

    def __init__(self):
        self.store = SimpleNamespace(held_requests=0)
        self.held_rids: set = set()


def scheduler(queue, batches, overlap=True, tree=None, max_queued=None, max_running=8, preemption=False,
              grammars=False):
    return SimpleNamespace(enable_overlap=overlap, tree_cache=tree if tree is not None else Tree(),
                           waiting_queue=list(queue), result_queue=list(batches), max_queued_requests=max_queued,
                           max_running_requests=max_running, chunked_req=None, enable_priority_preemption=preemption,
                           grammar_manager=SimpleNamespace(has_waiting_grammars=lambda: grammars))


def extend_batch(*reqs, extend=True):
    return SimpleNamespace(reqs=list(reqs), forward_mode=SimpleNamespace(is_extend=lambda: extend)), None


def running(n: int = 0, full: bool = False):
    return SimpleNamespace(reqs=[object()] * n, batch_is_full=full, is_empty=lambda: n == 0)


def test_the_formation_sees_only_the_requests_ahead_of_the_held_one_and_the_queue_keeps_its_order():
    b, a, c = waiting("b", [7] * 50), waiting("a", SYSTEM + [1]), waiting("c", [6] * 50)
    late = waiting("late", [8] * 50)
    sched = scheduler([b, a, c], [extend_batch(in_flight(SYSTEM + [3]))])
    seen = []

    def formation(s, running_batch):
        seen.append(list(s.waiting_queue))
        s.waiting_queue = [r for r in s.waiting_queue if r is not b] + [late]  # admits b, queues a preempted one
        return "plan"

    assert prefill_hold_hook(formation, sched, running()) == "plan"
    assert seen == [[b]]  # c, behind the held request, is not admitted before it
    assert sched.waiting_queue == [a, c, late] and sched.tree_cache.store.held_requests == 1
    # the next formation (the in-flight prefill still unprocessed): a request is held once only
    assert prefill_hold_hook(formation, sched, running()) == "plan"
    assert seen[-1] == [a, c, late] and sched.tree_cache.store.held_requests == 1


def test_a_request_that_left_the_queue_can_be_held_again_when_it_returns():
    """A retracted request comes back to the queue under its rid: its earlier hold is forgotten once it left."""
    a, b = waiting("a", SYSTEM + [1]), waiting("b", [7] * 50)
    sched = scheduler([a], [extend_batch(in_flight(SYSTEM + [3]))])
    prefill_hold_hook(lambda s, running_batch: None, sched, running())
    sched.waiting_queue = [b]  # a was admitted
    prefill_hold_hook(lambda s, running_batch: None, sched, running())
    sched.waiting_queue = [a]  # and retracted
    seen = []
    prefill_hold_hook(lambda s, running_batch: seen.append(list(s.waiting_queue)), sched, running_batch=running())
    assert seen == [[]] and sched.tree_cache.store.held_requests == 2


def test_the_queue_is_put_back_when_the_formation_raises():
    a, b = waiting("a", SYSTEM + [1]), waiting("b", [7] * 50)
    sched = scheduler([a, b], [extend_batch(in_flight(SYSTEM + [3]))])

    def formation(s, running_batch):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        prefill_hold_hook(formation, sched, running())
    assert sched.waiting_queue == [a, b]


def test_only_as_many_waiting_requests_as_the_formation_could_admit_are_looked_at():
    far = waiting("far", SYSTEM + [1])
    queue = [waiting(f"o{i}", [7 + i] * 50) for i in range(3)] + [far]
    batch = extend_batch(in_flight(SYSTEM + [3]))
    sched = scheduler(queue, [batch], max_running=8)
    seen = []
    prefill_hold_hook(lambda s, running_batch: seen.append(len(s.waiting_queue)), sched, running(5))  # room for 3
    assert seen == [4] and not sched.tree_cache.held_rids
    prefill_hold_hook(lambda s, running_batch: seen.append(len(s.waiting_queue)), sched, running(4))  # room for 4
    assert seen[-1] == 3 and sched.tree_cache.held_rids == {"far"}


@pytest.mark.parametrize("case", ["overlap off", "another tree", "decode in flight", "nothing in flight",
                                  "queue limit", "batch full", "no room", "priority preemption",
                                  "grammars compiling"])
def test_the_hook_leaves_the_queue_alone_unless_an_in_flight_prefill_can_help_an_admission(case):
    a = waiting("a", SYSTEM + [1])
    batch = extend_batch(in_flight(SYSTEM + [3]), extend=case != "decode in flight")
    sched = scheduler([a], [] if case == "nothing in flight" else [batch], overlap=case != "overlap off",
                      tree=object() if case == "another tree" else None, max_queued=64 if case == "queue limit" else None,
                      max_running=2 if case == "no room" else 8, preemption=case == "priority preemption",
                      grammars=case == "grammars compiling")
    seen = []
    prefill_hold_hook(lambda s, running_batch: seen.append(list(s.waiting_queue)), sched,
                      running(2, full=case == "batch full"))
    assert seen == [[a]] and sched.waiting_queue == [a] and not getattr(sched.tree_cache, "held_rids", None)


def test_a_full_batch_that_sglang_reopens_still_gets_the_hold():
    """SGLang clears ``batch_is_full`` itself when the running batch is empty."""
    a = waiting("a", SYSTEM + [1])
    sched = scheduler([a], [extend_batch(in_flight(SYSTEM + [3]))])
    seen = []
    prefill_hold_hook(lambda s, running_batch: seen.append(list(s.waiting_queue)), sched, running(0, full=True))
    assert seen == [[]]
