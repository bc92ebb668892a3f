"""The per-head KV store against a plain Python model of it (random batched appends, decisions, releases), and
its batched decisions against ``RequestState`` (the engine-independent core, itself checked against kvpress in
test_core_kvpress_parity.py): two implementations of kvpress's rule that must keep the same entries."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvzap_export.errors import InputError
from kvzap_export.integrations.core import KVzapPolicy, RequestState
from kvzap_export.integrations.ragged_store import RaggedStore, StoreFull

L, H, D = 2, 3, 4


class Model:
    """Each (row, layer, head)'s held logical positions, in order; which position each entry id holds."""

    def __init__(self):
        self.rows: dict[int, list[list[list[int]]]] = {}
        self.logical: dict[int, int] = {}

    def append(self, store, rows, counts, new):
        T = 0
        for r, n in zip(rows, counts):
            base = self.logical.get(r, 0)
            held = self.rows.setdefault(r, [[[] for _ in range(H)] for _ in range(L)])
            for t in range(n):
                for layer in range(L):
                    for head in range(H):
                        held[layer][head].append(base + t)
                        store.k[new[layer, head, T + t], 0] = base + t  # the entry remembers its position
                        store.v[new[layer, head, T + t], 0] = -(base + t)  # (decisions may move entries)
            self.logical[r] = base + n
            T += n

    def check(self, store):
        held = sum(len(h) for rows in self.rows.values() for layer in rows for h in layer)
        if store.mirror.held_copies:  # the snapshots have not arrived: the host's figures are bounds, then exact
            assert store.available <= store.capacity - held
            slots = list(store.slot_of.values())
            assert bool((store.lengths_host[slots] >= store.lengths[slots]).all())
            store.exact()
        assert store.held == held and store.available == store.capacity - held
        for r, rows in self.rows.items():
            for layer in range(L):
                for head in range(H):
                    ids = store.row_entries(r, layer, head)
                    assert store.k[ids, 0].tolist() == [float(p) for p in rows[layer][head]]
                    assert store.v[ids, 0].tolist() == [-float(p) for p in rows[layer][head]]
                    assert int(store.lengths[store.slot_of[r], layer, head]) == len(rows[layer][head])  # device == host mirror


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "prefill", "decode", "release"]),
                          st.lists(st.integers(0, 4), min_size=1, max_size=3, unique=True),
                          st.integers(1, 6), st.integers(0, 2**16)), min_size=1, max_size=25))
def test_store_matches_a_python_model_and_never_leaks(ops):
    for held_copies in (False, True):  # snapshots applied at once (the CPU), or arriving late (a GPU's, simulated)
        _model_run(ops, held_copies)


def _model_run(ops, held_copies: bool) -> None:
    store = RaggedStore(600, L, H, D, rows=2, width=4)  # tables start small: growth is exercised
    store.mirror.held_copies = held_copies
    model = Model()
    window = 3
    tested: dict[int, int] = {}  # row -> positions below it decided (the engine's order of events)
    decided: set[int] = set()  # rows a decision has tested since they took their first entry
    for op, rows, n, seed in ops:
        g = torch.Generator().manual_seed(seed)
        if op == "append":
            counts = [n if i % 2 == 0 else 1 for i in range(len(rows))]
            if store.available < sum(counts) * L * H:
                with pytest.raises(StoreFull):
                    store.append(rows, counts)
                continue
            new = store.append(rows, counts)
            store.scores[new.reshape(-1)] = torch.randn(new.numel(), generator=g)
            model.append(store, rows, counts, new)
        elif op == "release":
            for r in rows:
                store.release(r)
                model.rows.pop(r, None)
                model.logical.pop(r, None)
                tested.pop(r, None)
                decided.discard(r)
        else:
            rows = [r for r in rows if r in model.rows]
            if op == "prefill":  # a prompt is decided once, before any other decision (as the engine calls it)
                rows = [r for r in rows if r not in decided]
            before = {r: [[list(h) for h in layer] for layer in model.rows[r]] for r in rows}
            scores = {}
            for r in rows:
                for layer in range(L):
                    for head in range(H):
                        ids = store.row_entries(r, layer, head)
                        scores[r, layer, head] = dict(zip(model.rows[r][layer][head], store.scores[ids].tolist()))
            if op == "decode":  # the engine decides after every decode token: never more than one leaves at once
                rows = [r for r in rows if model.logical[r] - window - tested.get(r, 0) <= 1]
            freed = (store.decide_prefill if op == "prefill" else store.decide_decode)(rows, 0.0, window)
            decided.update(rows if op == "prefill" else
                           [r for r in rows if model.logical[r] - window - tested.get(r, 0) == 1])
            expect = 0
            for r in rows:
                for layer in range(L):
                    for head in range(H):
                        held = before[r][layer][head]
                        logical = model.logical[r]
                        if op == "prefill":
                            kept = [p for i, p in enumerate(held) if i >= len(held) - window or scores[r, layer, head][p] >= 0]
                        elif logical - window - tested.get(r, 0) == 1:  # one untested position left the window
                            leaving = logical - window - 1
                            kept = [p for p in held if p != leaving or scores[r, layer, head][p] >= 0]
                        else:
                            kept = held
                        expect += len(held) - len(kept)
                        model.rows[r][layer][head] = kept
                if op == "prefill":
                    tested[r] = max(0, model.logical[r] - window)
                elif model.logical[r] - window - tested.get(r, 0) == 1:
                    tested[r] = tested.get(r, 0) + 1
            assert freed == expect
        model.check(store)
    store.clear()
    assert store.available == store.capacity and store.rows == []
    assert sorted(store._free[: store.available].tolist()) == list(range(store.capacity))  # each id exactly once


@pytest.mark.parametrize("fraction", [0.4, 0.7])
def test_a_threshold_set_by_the_pruned_fraction_prunes_that_fraction_of_the_first_prompts(fraction):
    """``KVZAP_PRUNED_FRACTION`` (ragged mode's benchmark setting for dummy weights): τ is the quantile of the first
    decided prompts' scores outside the window (computed here from the rows' entries, position by position), and the
    prompt decision at that τ then frees that fraction of the tested entries."""
    import logging

    from kvzap_export.integrations.sglang.ragged import RaggedKVzapSGLang

    store = RaggedStore(5000, L, H, D, rows=2, width=8)
    rows, window = [3, 8], 4
    store.append(rows, [60, 45])
    store.scores[:5000] = torch.randn(5000, generator=torch.Generator().manual_seed(5))
    tested = sorted(float(store.scores[i]) for r in rows for layer in range(L) for head in range(H)
                    for i in store.row_entries(r, layer, head)[:-window].tolist())
    runtime = RaggedKVzapSGLang.__new__(RaggedKVzapSGLang)  # only its policy and setting: no scorer needed here
    runtime.policy, runtime.pruned_fraction = KVzapPolicy(threshold=-99.0, window=window, layout="ragged"), fraction
    logging.getLogger("kvzap_export").setLevel(logging.ERROR)
    runtime._threshold_from_scores(store, rows)
    assert runtime.pruned_fraction is None  # once
    tau = runtime.policy.threshold
    assert tau == pytest.approx(float(torch.quantile(torch.tensor(tested), fraction)), rel=1e-6)
    freed = int(store.decide_prefill(rows, tau, window))
    assert freed == sum(s < tau for s in tested) and abs(freed / len(tested) - fraction) < 0.01


def test_append_returns_this_forwards_entries_in_token_order_and_bad_input_is_refused():
    store = RaggedStore(200, L, H, D)
    first = store.append([5, 2], [3, 2])
    assert first.shape == (L, H, 5) and len(set(first.reshape(-1).tolist())) == L * H * 5
    for layer in range(L):
        for head in range(H):
            assert store.row_entries(5, layer, head).tolist() == first[layer, head, :3].tolist()
            assert store.row_entries(2, layer, head).tolist() == first[layer, head, 3:].tolist()
    second = store.append([2], [1])
    assert store.row_entries(2, 1, 0)[-1] == second[1, 0, 0]
    assert store.widths([5, 2]) == [3, 3]
    slots = store.slots([2, 5])
    assert torch.equal(store.layer_ids(slots, 1, 3)[1, :, :3], first[1, :, :3].to(torch.int32))
    with pytest.raises(InputError, match="distinct rows"):
        store.append([1, 1], [1, 1])
    assert store.release(5) == 3 * L * H and store.release(5) == 0
    with pytest.raises(StoreFull):
        store.append([7], [100])
    assert store.rows == [2]  # a failed append takes nothing, not even a table


def test_tables_follow_the_requests_held_not_the_engines_row_numbers():
    """Row ids up to 10**6 with 3 requests held: 4 tables (the initial count), reused after releases."""
    store = RaggedStore(400, L, H, D, rows=4, width=4)
    store.append([10**6, 7, 123456], [2, 2, 2])
    assert store.lengths.shape[0] == 4
    store.release(7)
    store.append([99, 98], [1, 1])
    assert store.lengths.shape[0] == 4 and sorted(store.rows) == [98, 99, 123456, 10**6]
    store.append([5], [9])  # a fifth request: the tables grow, every row keeps its entries
    assert store.lengths.shape[0] == 5 and int(store.table.cap[store.slot_of[5]].min()) >= 9
    assert store.row_held(10**6) == 2 * L * H and store.row_held(5) == 9 * L * H


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.sampled_from([0, 2, 6]), st.sampled_from([0, 1]), st.booleans(), st.booleans(),
       st.integers(0, 2**16))
def test_batched_decisions_keep_what_request_state_keeps(requests, window, sink, decoding, chunked, seed):
    """Several requests at once: a prompt (in two chunks, decided after the last), then decode steps; the store's
    kept positions equal ``RequestState``'s (ragged layout) in every (request, layer, head). NaN scores are kept."""
    g = torch.Generator().manual_seed(seed)
    policy = KVzapPolicy(threshold=0.0, window=window, sink=sink, decoding=decoding, layout="ragged")
    store = RaggedStore(4000, L, H, D, rows=1, width=2)
    rows = list(range(1, requests + 1))
    states = {r: RequestState(policy, L, H) for r in rows}

    def feed(counts, prefill):
        new = store.append(rows, counts)
        scores = torch.randn(L, H, new.shape[-1], generator=g)
        scores[torch.rand(scores.shape, generator=g) < 0.05] = float("nan")
        store.scores[new.reshape(-1)] = scores.reshape(-1)
        start = 0
        for r, n in zip(rows, counts):
            for t in range(n):  # each entry remembers its logical position (a decision may move entries)
                store.k[new[:, :, start + t].reshape(-1), 0] = float(store.logical[r] - n + t)
            chunk = scores[:, :, start: start + n]
            if prefill is None:
                states[r].append(chunk)
            elif prefill:
                states[r].prefill(chunk)
            else:
                states[r].decode(chunk)
            start += n

    prompt = [int(torch.randint(1, 12, (), generator=g)) for _ in rows]
    if chunked:
        feed([max(1, p // 2) for p in prompt], None)  # the engine appends chunks and decides after the last one
    feed(prompt, True)
    store.decide_prefill(rows, 0.0, window, sink)
    for _ in range(int(torch.randint(1, 15, (), generator=g))):
        feed([1] * len(rows), False)
        if decoding:
            store.decide_decode(rows, 0.0, window, sink)
    for r in rows:
        for layer in range(L):
            for head in range(H):
                mine = [int(p) for p in store.k[store.row_entries(r, layer, head), 0].tolist()]
                assert mine == states[r].kept_positions(layer, head).tolist(), (r, layer, head)


def test_decode_decisions_refuse_nothing_they_cannot_see():
    """A row no longer than the window has nothing leaving it: untouched."""
    store = RaggedStore(100, L, H, D)
    new = store.append([1], [3])
    store.scores[new.reshape(-1)] = -5.0
    assert store.decide_decode([1], 0.0, window=3) == 0 and store.row_held(1) == 3 * L * H
    new = store.append([1], [1])
    store.scores[new.reshape(-1)] = -5.0
    assert store.decide_decode([1], 0.0, window=3) == L * H  # position 0 left the window, scored below τ
    assert store.row_held(1) == 3 * L * H


def test_a_prompt_decision_moves_the_survivors_to_the_rows_first_entries_and_frees_its_last():
    """The decode path gathers each row's entries at every step: after a prompt's decision they stay as dense in the
    pool as the prompt was (the survivors, in order, in the row's first ids; K, V and scores moved with them), and the
    next prompt takes what was freed in ascending order."""
    store = RaggedStore(200, L, H, D)
    new = store.append([1], [8])  # ascending, contiguous ids per (layer, head)
    assert all(torch.equal(new[layer, head], new[layer, head].sort().values) for layer in range(L) for head in range(H))
    scores = torch.randn(L, H, 8, generator=torch.Generator().manual_seed(3))
    scores[0, 0] = torch.tensor([5.0, -1, -1, 5, -1, 5, -1, -1])  # window 2 keeps positions 6, 7
    store.scores[new.reshape(-1)] = scores.reshape(-1)
    data = torch.arange(new.numel(), dtype=torch.float32).view(L, H, 8)
    store.k[new.reshape(-1), 0], store.v[new.reshape(-1), 1] = data.reshape(-1), -data.reshape(-1)
    freed = store.decide_prefill([1], 0.0, window=2)
    kept_all = 0
    for layer in range(L):
        for head in range(H):
            kept = [p for p in range(8) if p >= 6 or scores[layer, head, p] >= 0]
            kept_all += len(kept)
            ids = store.row_entries(1, layer, head)
            assert ids.tolist() == new[layer, head, : len(kept)].tolist()  # the row's first ids
            assert store.k[ids, 0].tolist() == data[layer, head, kept].tolist()
            assert store.v[ids, 1].tolist() == (-data[layer, head, kept]).tolist()
            assert torch.equal(store.scores[ids], scores[layer, head, kept])
    assert freed == L * H * 8 - kept_all and store.available == store.capacity - kept_all
    assert store.row_entries(1, 0, 0).numel() == 5  # positions 0, 3, 5 and the window's 6, 7
    later = store.append([2], [3])  # a prompt reuses the freed ids, ascending
    assert all(torch.equal(later[layer, head], later[layer, head].sort().values) for layer in range(L) for head in range(H))
    held = {e for layer in range(L) for head in range(H) for e in store.row_entries(1, layer, head).tolist()}
    assert held.isdisjoint(later.reshape(-1).tolist())
