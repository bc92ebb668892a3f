"""KVzap inside the real SGLang 0.5.23 engine on the CPU, request streams through the driver
(``python -m kvzap_export.integrations.sglang.driver``): many requests at once in a small pool, aborts, the radix
cache shared between requests, the overlap scheduler, host reads per step, and KVzap's radix tree driven step by step
(``radix_tree_script.py``). Every output is compared with kvpress's tokens for its setting (``engine_runs.py``).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.integrations.sglang.engine_runs import NEW_TOKENS, reference_prompts, reference_stream, run_driver

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

PER_TOKEN = 2 * 2  # radix_tree_script.py's layers x KV heads


def test_ragged_pool_gets_every_entry_back_after_a_stream_with_aborts(qwen3, tmp_path):
    """200 requests of mixed lengths and settings (some KVzap off), half of them starting with one of three shared
    prefixes, submitted at once to a small pool with SGLang's radix cache on, a fifth aborted mid-generation: once the
    scheduler is idle, no row holds an entry and every entry not free is one the tree's cached prompts hold (SGLang's
    own idle check, ``available + evictable == max_total_num_tokens``, runs on the same counts)."""
    import random

    model, bundle = qwen3
    ids = [i for p in reference_prompts(bundle) for i in p]
    rng = random.Random(0)
    stream = []
    shared = [rng.randint(0, len(ids) - 300) for _ in range(3)]
    for i in range(200):
        n = rng.randint(3, 300)
        start = rng.choice(shared) if i % 2 else rng.randint(0, len(ids) - n)
        request = {"input_ids": ids[start: start + n], "max_new_tokens": rng.randint(1, 40),
                   "kvzap": rng.choice(["decoding", "prefill", "off"])}
        if i % 5 == 0:
            request["abort_after"] = rng.uniform(0.05, 1.5)
        stream.append(request)
    stream[7]["kvzap"] = "bogus"  # a bad request parameter aborts that request only, never the server
    spec = {"model": str(model), "bundle": str(bundle), "mode": "ragged", "stream": stream,
            "engine": {"max_total_tokens": 1500, "max_running_requests": 12}}
    done = run_driver(tmp_path, spec, KVZAP_COUNT_HOST_READS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    # aborts, retractions, mixed settings: still one count per decode step, except in a step whose allocation takes
    # back soft entries (the tree's eviction and the records it drops: a handful of reads and boolean selections);
    # the decode steps' decisions read nothing (on the device alone: ragged_mirror.py)
    forward, step_end = decode_host_reads(out, without_reclaims=True)
    assert len(forward) == 1 and step_end == 0, (forward, step_end)
    finishes = [r["finish"] for r in out["stream"]]
    assert len(finishes) == 200 and finishes.count("abort") >= 5, finishes
    assert finishes[7] == "abort" and finishes.count("length") >= 100
    steps = [r for r in out["readings"] if r.get("event") != "idle"]
    assert max(r["running_requests"] for r in steps) > 1  # requests really shared the pool
    assert max(r["head_slots_held"] for r in steps) > 0.5 * steps[0]["head_slots_pool"]  # and filled it
    idle = [r for r in out["readings"] if r.get("event") == "idle"]
    assert idle and idle[-1]["t"] > max(r["t"] for r in steps)
    last = idle[-1]
    assert last["head_slots_held"] == 0 and last["rows"] == 0  # no row holds anything
    assert last["head_slots_free"] + last["head_slots_cached"] == last["head_slots_pool"]  # the tree's, or free
    per_token = steps[0]["layers"] * steps[0]["kv_heads"]
    assert last["head_slots_cached"] == per_token * last["slots_held"] > 0  # each cached token: all its entries
    assert max(r.get("cache_nodes_reclaimed", 0) for r in out["readings"]) > 0  # running prompts' soft entries taken



def concurrent_reference_stream(model, bundle, mode, tmp_path, pool_requests: int = 8, **engine) -> tuple[dict, list]:
    """The reference prompts, four copies each, kvpress decoding=True and =False mixed, submitted at once (up to 8
    running, a pool of ``pool_requests`` requests' worth, ``engine``: more engine arguments), with
    KVZAP_COUNT_HOST_READS=1; returns the driver's result and the kvpress tokens each must equal."""
    stream, expected = reference_stream(bundle)
    longest = max(len(r["input_ids"]) for r in stream)
    spec = {"model": str(model), "bundle": str(bundle), "mode": mode, "stream": stream,
            "engine": {"max_running_requests": 8, "max_total_tokens": pool_requests * (longest + NEW_TOKENS + 8), **engine}}
    tmp_path.mkdir(parents=True, exist_ok=True)
    done = run_driver(tmp_path, spec, KVZAP_COUNT_HOST_READS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp_path / "out.json").read_text()), expected


def test_ragged_mode_shares_prompts_exactly_in_a_pool_its_tree_must_make_room_in(qwen3, tmp_path):
    """SGLang's radix cache on (ragged mode's default): four copies of each reference prompt submitted at once to a
    pool of two requests' worth, so requests adopt cached prompts' entries while the tree evicts prompts no request
    locks (and, depending on the order SGLang admits them in, takes back soft entries of prompts running requests
    read): every output still equals kvpress's tokens, and requests took prompts from the cache."""
    model, bundle = qwen3
    out, expected = concurrent_reference_stream(model, bundle, "ragged", tmp_path, pool_requests=2)
    assert [r["output_ids"] for r in out["stream"]] == expected
    assert max(r["cached_tokens"] or 0 for r in out["stream"]) > 0


def test_ragged_mode_without_the_radix_cache_moves_survivors_and_still_gives_kvpress_tokens(qwen3, tmp_path):
    """The radix cache off (the long-prompt benchmark's setting): each prompt decision moves its survivors into its
    row's first ids (``RaggedStore.moves_kept``) and a pool of five requests' worth (sixteen requests, up to eight
    running) makes later prompts take the ids earlier ones freed. Every output equals kvpress's tokens, nothing came
    from a cache, and decode steps still read tensor values a constant number of times."""
    model, bundle = qwen3
    out, expected = concurrent_reference_stream(model, bundle, "ragged", tmp_path, pool_requests=5,
                                                disable_radix_cache=True)
    assert out["engine"]["resolved"]["disable_radix_cache"] is True
    assert [r["output_ids"] for r in out["stream"]] == expected
    assert all(not r["cached_tokens"] for r in out["stream"])
    forward, step_end = decode_host_reads(out)
    assert len(forward) == 1 and step_end == 0, (forward, step_end)  # the decisions run on the device alone


def test_under_the_overlap_scheduler_every_repeat_of_a_prompt_in_a_burst_takes_it_from_the_cache(qwen3, tmp_path):
    """The overlap scheduler forms a batch before it inserts the last one's prompts into the radix tree; KVzap's glue
    holds a request that shares a prefix with a prefill in flight out of that one formation
    (``ragged_radix.prefill_hold_hook``). The reference prompts (400 tokens), four copies each and both kvpress
    settings, submitted at once, one request per prefill batch (SGLang's default policy computes two copies of a prompt
    admitted into one batch twice, a cost the hold does not address), a pool that evicts nothing: every
    repeat of a prompt takes all but its last token from the cache, the readings count the holds, and every output
    still equals kvpress's tokens. Without the hold (the registration commented out, once), the second run of each
    prompt, formed while the first was in flight, took 0, 3 and 1 tokens from the cache."""
    model, bundle = qwen3
    out, expected = concurrent_reference_stream(model, bundle, "ragged", tmp_path, pool_requests=32,
                                                prefill_max_requests=1)
    assert [r["output_ids"] for r in out["stream"]] == expected
    assert out["engine"]["resolved"]["disable_overlap_schedule"] is False
    per_copy = len(out["stream"]) // 4
    assert per_copy == 2 * len(reference_prompts(bundle))  # each prompt: a kvpress decoding=True run, then =False
    first, repeats = out["stream"][:per_copy], out["stream"][per_copy:]
    assert [r["cached_tokens"] for r in first[1::2]] == [r["prompt_tokens"] - 1 for r in first[1::2]], first
    assert [r["cached_tokens"] for r in repeats] == [r["prompt_tokens"] - 1 for r in repeats], repeats
    assert max(r.get("cache_holds", 0) for r in out["readings"]) > 0  # the glue held requests (the store's count)


@pytest.fixture(scope="module")
def radix_tree_run() -> dict:
    """``radix_tree_script.py``'s readings, run once in the SGLang environment."""
    from tests.conftest import sglang_python

    done = subprocess.run([sglang_python(), str(Path(__file__).with_name("radix_tree_script.py"))], capture_output=True,
                          text=True, timeout=600, env={**__import__("os").environ, "SGLANG_USE_CPU_ENGINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_tree_takes_back_a_shared_prefix_two_running_requests_read_and_frees_nothing_they_hold(radix_tree_run):
    """KVzap's radix tree (SGLang's ``RadixCache`` subclassed) driven step by step as the scheduler drives it, in the
    SGLang environment (``radix_tree_script.py``): request A's prompt cached and locked; B's admission locks A's first
    8 tokens as SGLang's adder does (a temporary lock, the committing one inside it, the temporary one ended first: the
    soft entries B will adopt stop being room until the adoption), B's row adopts them whole (A's evicted tokens
    included); both evict tokens 2..5; the store runs short and the reclaim takes those back from the locked shared
    node while A and B still run: no entry either row holds is freed (every free entry then overwritten, the rows'
    K unchanged), a new match stops before the broken node, which is cut once A and B end; at idle SGLang's
    available + evictable is the pool, and after SGLang's eviction every entry is free."""
    out = radix_tree_run
    assert out["idle_start"] == out["tokens"] and out["soft_after_a"] == 16
    assert out["room_lost_at_admission"] == 4 and out["room_lost_at_second_admission"] == 4
    assert out["b_prefix"] == 8 and out["b_holds_a_evicted_tokens"]
    assert out["reclaimed_nodes"] == 1 and out["row_entries_freed_early"] == 0 and out["row_k_unchanged"]
    assert out["c_prefix_after_break"] == 0
    assert out["idle_after"] == out["tokens"] and out["cached_entries"] == 0 and out["tree_tokens"] == 0
    assert out["free_after_evict"] == out["capacity"]


def test_the_tree_reclaim_ends_records_of_prompts_not_in_it_yet_and_frees_nothing_rows_hold(radix_tree_run):
    """The reclaim's last stage (the overlap scheduler inserts a prompt into the tree a step after KVzap recorded it):
    with nothing in the tree, an allocation one token's entries short drops the records of the prompt with the most
    soft entries (F, row 1: 4 tokens evicted, against E's 1), only that one; its recorded length falls back (the tree
    will not cache it), E's stays; no entry a row holds is freed, and every entry comes back when all end."""
    out = radix_tree_run["unanchored"]
    assert out["evictable"] == 0 and out["rows_before"] == [0, 1] and out["soft_before"] == 5 * PER_TOKEN
    assert out["short"] == PER_TOKEN  # the allocation needs one token's entries more than are free
    assert out["freed"] == 4 * PER_TOKEN and out["dropped_prompts"] == 1 and out["reclaimed_nodes"] == 0
    assert out["rows_after"] == [0] and out["dense_len"] == [10, 0] and out["soft_after"] == PER_TOKEN
    assert out["row_entries_freed_early"] == 0
    assert out["free_at_end"] == out["capacity"]


def test_a_request_preempted_after_another_was_admitted_on_its_prefix_frees_no_room_the_admitted_one_adopts(
        radix_tree_run):
    """SGLang's priority preemption within one formation: the running request's entries on the prefix the admitted
    request adopts turn soft when it is preempted, but stay out of the room; only the 2 tokens nobody adopts become
    room (evictable)."""
    out = radix_tree_run["preempted"]
    assert out["s_prefix"] == 8 and out["room_lost_at_admission"] == 0
    assert out["room_gained_at_preemption"] == 2 and out["room_gained_after_adoption"] == 2
    assert out["free_at_end"] == out["capacity"]


def decode_host_reads(out: dict, without_reclaims: bool = False) -> tuple[set, int]:
    """(the forward counts of every decode step, the largest step-end count), after checking batches ran. In ragged
    mode the forward counts are those of the decode steps in which no row outgrew its room in the row tables (it moves:
    a few host reads, ``table_rows_moved`` grew since the step before) and, with ``without_reclaims``, no allocation
    took back soft entries (``cache_reclaims`` grew); the step-end count is still every step's."""
    decode = [r for r in out["readings"] if r.get("forward") == "decode"]
    assert max(r["running_requests"] for r in decode) >= 4  # batched decode steps really ran
    keys = ("table_rows_moved",) + (("cache_reclaims",) if without_reclaims else ())
    steps = [r for r in out["readings"] if r.get("event") != "idle"]
    before, last, t = {}, {}, None  # step time -> the counters at the end of the step before it
    for r in sorted(steps, key=lambda r: r["t"]):
        if r["t"] != t:
            before[r["t"]], t = dict(last), r["t"]
        last = {k: r.get(k, 0) for k in keys}
    quiet = [r for r in decode if all(r.get(k, 0) == before[r["t"]].get(k, 0) for k in keys)]
    if without_reclaims:
        grown = [r for r in decode if r.get("cache_reclaims", 0) != before[r["t"]].get("cache_reclaims", 0)]
        assert grown, "no decode step reclaimed soft entries: the stream did not fill the pool"
    assert quiet, "every decode step moved a row"
    return {r["host_reads"]["forward"] for r in quiet}, max(r["host_reads"]["step_end"] for r in decode)


@pytest.mark.parametrize("mode", ["ragged", "mask", "evict"])
def test_concurrent_requests_give_kvpress_tokens_with_a_constant_number_of_host_reads(request, tmp_path, mode):
    """Decode steps batch up to 8 requests (one attention call per layer for the batch) and every output still
    equals kvpress's tokens for its setting. The scheduler counts the reads of tensor values into Python its KVzap
    code made in each step (``host_reads.py``; on a GPU each is a stall): the forward's count (aux cache, batch
    view, every layer's attention and scoring) is the same at every decode step whatever the batch, and in ragged
    mode the same on SmolLM2's 30 layers as on the tiny Qwen3's 4, and none at the step end (the decisions run on the
    device alone; the host learns their counts from a snapshot at the next step's layout), nor do the prefill step ends
    (decisions, the radix cache's records) or the releases. Mask and evict modes still decide request by request at the step end (RequestState),
    a few reads per request: not held constant here."""
    which = ["smollm2", "qwen3"] if mode == "ragged" else ["qwen3"]
    forward_counts = set()
    for name in which:
        model, bundle = request.getfixturevalue(name)
        out, expected = concurrent_reference_stream(model, bundle, mode, tmp_path / name)
        assert [r["output_ids"] for r in out["stream"]] == expected
        assert out["engine"]["resolved"]["disable_overlap_schedule"] is False  # SGLang's overlap scheduler ran
        forward, step_end = decode_host_reads(out)
        assert len(forward) == 1, sorted(forward)
        forward_counts |= forward
        if mode == "ragged":  # the decode steps' decisions: on the device alone, no read (ragged_mirror.py)
            assert step_end == 0, step_end
            # radix cache on: the prefill step ends' decisions and records, and SGLang's frees of finished rows and of
            # slots (the records that end with them) read nothing either
            steps = [r for r in out["readings"] if r.get("event") != "idle"]
            prefill = [r["host_reads"]["step_end"] for r in steps if r["forward"] == "extend"]
            assert out["engine"]["resolved"]["disable_radix_cache"] is False
            assert prefill and max(prefill) == 0, prefill
            assert max(r["host_reads"]["release"] for r in steps) == 0
    assert len(forward_counts) == 1, forward_counts
