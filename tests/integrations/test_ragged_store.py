"""The per-head KV store against a plain Python model of it: random appends, compactions and releases."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvzap_export.errors import InputError
from kvzap_export.integrations.ragged_store import RaggedStore, StoreFull

L, H, D = 2, 3, 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "compact", "release"]), st.integers(0, 2), st.integers(1, 6),
                          st.integers(0, 2**16)), min_size=1, max_size=30))
def test_store_matches_a_python_model_and_never_leaks(ops):
    store = RaggedStore(400, L, H, D)
    model: dict[int, list[list[list[int]]]] = {}  # row -> [layer][head] -> logical positions held
    values: dict[int, int] = {}  # entry id -> the logical position written there
    for op, row, n, seed in ops:
        g = torch.Generator().manual_seed(seed)
        if op == "append":
            if store.available < n * L * H:
                with pytest.raises(StoreFull):
                    store.append(row, n)
                continue
            logical = store.rows[row].logical if row in store.rows else 0
            ids = store.append(row, n)
            rows = model.setdefault(row, [[[] for _ in range(H)] for _ in range(L)])
            for layer in range(L):
                for head in range(H):
                    for t in range(n):
                        rows[layer][head].append(logical + t)
                        store.k[ids[layer, head, t]] = logical + t
                        values[int(ids[layer, head, t])] = logical + t
        elif op == "compact" and row in store.rows:
            table = store.rows[row]
            keep = torch.rand(L, H, table.ids.shape[-1], generator=g) < 0.5
            keep &= torch.arange(table.ids.shape[-1]) < table.lengths[..., None]
            counts = keep.sum(-1)
            k = int(counts.max())
            order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[..., :k]
            indices = torch.where(torch.arange(k) < counts[..., None], order, -1)
            before = store.available
            freed = store.compact(row, indices, counts)
            assert store.available == before + freed
            for layer in range(L):
                for head in range(H):
                    kept = indices[layer, head, : counts[layer, head]].tolist()
                    model[row][layer][head] = [model[row][layer][head][j] for j in kept]
        elif op == "release":
            store.release(row)
            model.pop(row, None)
        held = sum(len(h) for rows in model.values() for layer in rows for h in layer)
        assert store.held == held and store.available == 400 - held
        for r, rows in model.items():  # every (row, layer, head) lists its positions in order, with their K
            for layer in range(L):
                ids, positions, lengths = store.gather(r, layer)
                for head in range(H):
                    n_h = int(lengths[head])
                    assert positions[head, :n_h].tolist() == rows[layer][head]
                    assert store.k[ids[head, :n_h], 0].tolist() == [float(p) for p in rows[layer][head]]
    store.clear()
    assert store.available == 400 and store.rows == {}
    assert sorted(store._free[: store.available].tolist()) == list(range(400))  # each id exactly once


def test_last_entries_are_this_forwards_tokens_and_bad_input_is_refused():
    store = RaggedStore(100, L, H, D)
    first = store.append(5, 3)
    second = store.append(5, 2)
    assert torch.equal(store.last(5, 1, 2), second[1]) and torch.equal(store.last(5, 0, 5)[:, :3], first[0])
    with pytest.raises(InputError, match="holds nothing"):
        store.last(6, 0, 1)
    with pytest.raises(InputError, match="do not match"):
        store.compact(5, torch.zeros(L, H + 1, 2, dtype=torch.int64), torch.ones(L, H + 1, dtype=torch.int64))
    with pytest.raises(InputError, match="keeps more"):
        store.compact(5, torch.zeros(L, H, 9, dtype=torch.int64), torch.full((L, H), 9))
    assert store.release(5) == 5 * L * H and store.release(5) == 0
