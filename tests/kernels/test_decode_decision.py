"""The decode step's decision (``kernels.decode_decision``): the Triton kernel (compiled on a GPU, interpreted on the
CPU elsewhere: tests/conftest.py) equals the torch formula, and the formula is what the ragged store decides at a
decode step."""

import pytest
import torch

from kvzap_export.integrations.ragged_store import RaggedStore
from kvzap_export.kernels.decode_decision import decide_leaving, decide_table, launch_decide_leaving, recycle

WINDOW = 128
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the Triton kernel runs (compiled / interpreted)


def _on_kernel_device(*tensors):
    return [t.to(KERNEL_DEVICE) for t in tensors]


def _case(dtype, seed, rows=13, width=300, entries=5000):
    g = torch.Generator().manual_seed(seed)
    scores = (torch.randn(entries, generator=g) * 2 - 4).to(dtype)
    scores[::37] = float("nan")  # NaN is kept (strict <)
    ids = torch.randint(0, entries, (rows, width), generator=g, dtype=torch.int32)
    lengths = torch.randint(0, width + 1, (rows,), generator=g, dtype=torch.int32)
    lengths[:4] = torch.tensor([WINDOW, WINDOW + 1, width, 0], dtype=torch.int32)  # too short, just long enough, full, empty
    leaving = torch.randint(0, 2, (rows,), generator=g, dtype=torch.int32)
    leaving[1:3] = 1
    return scores, ids, lengths, leaving


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_kernel_equals_the_formula(dtype, seed):
    scores, ids, lengths, leaving = _case(dtype, seed)
    a_ids, a_len, b_ids, b_len = ids.clone(), lengths.clone(), ids.clone(), lengths.clone()
    want = decide_leaving(scores, a_ids, a_len, leaving, -4.0, WINDOW)
    k_scores, b_ids, b_len, k_leaving = _on_kernel_device(scores, b_ids, b_len, leaving)
    got = launch_decide_leaving(k_scores, b_ids, b_len, k_leaving, -4.0, WINDOW)
    assert torch.equal(got.cpu(), want) and torch.equal(b_ids.cpu(), a_ids) and torch.equal(b_len.cpu(), a_len)


def test_the_kernel_works_in_place_on_strided_rows_and_a_given_buffer():
    """Rows that are not adjacent in memory (head 0 of layer 1 of each slot of a [slots, layers, heads, width]
    table): the kernel writes the table itself."""
    scores, ids, lengths, leaving = _case(torch.float32, 7, rows=5)
    table = torch.zeros(5, 2, 4, ids.shape[1], dtype=torch.int32)
    table[:, 1, 0] = ids
    rows = table[:, 1, 0]  # [5, width], row stride 2 * 4 * width: a view, not a copy
    assert rows.stride(0) == 8 * ids.shape[1] and rows.data_ptr() == table[0, 1, 0].data_ptr()
    want_ids, want_len = ids.clone(), lengths.clone()
    want = decide_leaving(scores, want_ids, want_len, leaving, -4.0, WINDOW)
    (table,) = _on_kernel_device(table)
    rows = table[:, 1, 0]
    freed, got_len, scores, leaving = _on_kernel_device(torch.full((5,), 99, dtype=torch.int32), lengths.clone(), scores, leaving)
    got = launch_decide_leaving(scores, rows, got_len, leaving, -4.0, WINDOW, freed=freed)
    assert got.data_ptr() == freed.data_ptr() and torch.equal(got.cpu(), want) and torch.equal(got_len.cpu(), want_len)
    assert torch.equal(table[:, 1, 0].cpu(), want_ids) and not table[:, 0].any() and not table[:, 1, 1:].any()


def test_the_formula_is_the_ragged_stores_decode_decision():
    """The store decides at a decode step for every (request, layer, head): the same rows through
    ``decide_leaving`` give the same rows, lengths and freed entries."""
    g = torch.Generator().manual_seed(3)
    store = RaggedStore(4000, num_layers=2, num_kv_heads=3, head_dim=4)
    store.append([0, 1], [200, 150])
    store.scores[:4000].copy_(torch.randn(4000, generator=g) * 2 - 4)  # the last row is the scratch row
    store.decide_prefill([0, 1], -4.0, WINDOW)
    store.append([0, 1], [1, 1])  # one decode token each: one position leaves each row's window
    slots = store.slots([0, 1])
    width = int(store.lengths_host[store.slots_host([0, 1])].max())
    ids = store.table.gather(slots, width).reshape(-1, width).clone()
    lengths = store.lengths[slots].reshape(-1).clone()
    held_before = store.held
    freed_by_store = store.decide_decode([0, 1], -4.0, WINDOW)
    freed = decide_leaving(store.scores, ids, lengths, torch.ones_like(lengths), -4.0, WINDOW)
    assert int((freed >= 0).sum()) == freed_by_store == held_before - store.held
    assert torch.equal(lengths, store.lengths[slots].reshape(-1))
    after = store.table.gather(slots, width).reshape(-1, width)
    for r in range(ids.shape[0]):
        n = int(lengths[r])
        assert torch.equal(ids[r, :n], after[r, :n])


def test_shapes_are_checked():
    scores, ids, lengths, leaving = _case(torch.float32, 0)
    with pytest.raises(Exception, match="rows"):
        decide_leaving(scores, ids, lengths[:3], leaving, -4.0, WINDOW)


@pytest.mark.parametrize("seed", range(3))
def test_the_free_stack_is_a_stack(seed):
    """Freed ids pushed in row order, then the next ids popped from the new top (pushed ids included): what a Python
    list does."""
    g = torch.Generator().manual_seed(seed)
    rows, capacity, top = 37, 400, 150
    free = torch.randint(0, 10_000, (capacity + 1,), generator=g, dtype=torch.int32)
    freed = torch.where(torch.rand(rows, generator=g) < 0.4, torch.randint(0, 10_000, (rows,), generator=g), -1).to(torch.int32)
    freed[:2] = torch.tensor([-1, 5], dtype=torch.int32)
    stack = free[:top].tolist() + [i for i in freed.tolist() if i >= 0]
    want_fresh, stack = stack[-rows:], stack[:-rows]
    top_t, fresh = torch.tensor([top]), torch.zeros(rows, dtype=torch.int32)
    recycle(freed, free, top_t, fresh)
    assert int(top_t) == len(stack) and free[: len(stack)].tolist() == stack
    assert fresh.tolist() == want_fresh


def _table(seed, slots=6, layers=3, heads=2, width=200, entries=4000):
    g = torch.Generator().manual_seed(seed)
    scores = (torch.randn(entries, generator=g) * 2 - 4)
    scores[::29] = float("nan")
    ids = torch.randint(0, entries, (slots, layers, heads, width), generator=g, dtype=torch.int32)
    lengths = torch.randint(WINDOW - 8, width + 1, (slots, layers, heads), generator=g, dtype=torch.int32)
    lengths[0, 0] = torch.tensor([WINDOW, WINDOW + 1], dtype=torch.int32)  # too short, just long enough
    return scores, ids, lengths


@pytest.mark.parametrize("seed", range(3))
def test_decide_table_kernel_and_formula_equal_the_formula_row_by_row(seed):
    """The engine's call on chosen slots of a ``RowTable`` (rows of their own capacities in one buffer, laid out in a
    shuffled order, some just as wide as they are long): the Triton kernel in place (compiled on a GPU, interpreted
    here) and the torch formula on the rows' tails both give what ``decide_leaving`` gives on every row alone; every
    other cell of the buffer is untouched. The torch path calls ``decide_leaving`` itself, so for it this checks the
    gather and write-back of the rows' tails (plumbing); the kernel is the independent computation here, and the
    store's decisions are compared with ``RequestState`` in test_ragged_store.py."""
    from kvzap_export.integrations.row_table import RowTable

    scores, ids, lengths = _table(seed)
    S, L, H, W = ids.shape
    g = torch.Generator().manual_seed(seed)
    table = RowTable(S, L, H, 4 * S * L * H * W, "cpu")
    for slot in torch.randperm(S, generator=g).tolist():  # capacities: the row's length, or up to 40 more
        need = lengths[slot].to(torch.int64) + torch.randint(0, 2, (L, H), generator=g) * 40
        table.reserve(torch.tensor([slot]), need[None], lambda *t: t, torch.zeros(S, L, H, dtype=torch.int64))
    table.write(torch.arange(S), ids, torch.arange(W) < lengths[..., None])
    slots = torch.tensor([4, 0, 2])
    leaving = torch.tensor([1, 1, 0], dtype=torch.int32)
    want_ids, want_len = ids.clone(), lengths.clone()
    want = torch.full((3, L, H), -1, dtype=torch.int32)
    for b, slot in enumerate(slots.tolist()):
        rows, row_len = want_ids[slot].view(L * H, -1), want_len[slot].view(L * H)
        want[b] = decide_leaving(scores, rows, row_len, leaving[b].expand(L * H), -4.0, WINDOW).view(L, H)
    assert (want >= 0).any() and (want < 0).any()
    for use_triton in (False, True):
        data, got_len = table.data.clone(), lengths.clone()
        args = (scores, data, table.base, got_len, slots, leaving)
        k = _on_kernel_device(*args) if use_triton else args
        freed = decide_table(*k, -4.0, WINDOW, use_triton=use_triton)
        assert torch.equal(freed.cpu(), want), use_triton
        assert torch.equal(k[3].cpu(), want_len), use_triton
        after = k[1].cpu()
        at = table.index(torch.arange(S), torch.arange(W))
        held = torch.arange(W) < want_len[..., None]
        assert torch.equal(after[at][held], want_ids[held]), use_triton  # every row's held entries, as decided
        untouched = torch.ones_like(after, dtype=torch.bool)
        untouched[at[torch.arange(W) < lengths[..., None]]] = False  # the rows' cells held before the decision
        untouched[-1] = False  # the scratch cell
        assert torch.equal(after[untouched], table.data[untouched]), use_triton
