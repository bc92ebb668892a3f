"""Reads of tensor values into Python (a device->host transfer, a stall, on a GPU) during one ragged decode step:
the aux cache's host-side layout, the step's batch view, every layer's K/V write and attention, and the step's
decisions. Their number must not grow with the layers or the requests. The counter itself is checked first.

The same count runs inside the real SGLang engine (``KVZAP_COUNT_HOST_READS=1``, test_engine_streams.py), around the
backends' own methods."""

from __future__ import annotations

import sys

import torch

import pytest

from kvzap_export.integrations.host_reads import HostReads, Transfers, syncs
from kvzap_export.integrations.ragged_shared import SharedRaggedStore
from kvzap_export.integrations.ragged_store import RaggedStore
from kvzap_export.kernels.ragged_attention import decode_attention


def test_the_counter_sees_every_kind_of_read():
    t = torch.arange(6)
    with HostReads() as mode:
        int(t[0]), bool(t[1]), float(t[2]), t.tolist(), t[3].item(), t.numpy(), [0, 1][t[1]]
        t.to(torch.float32), t + 1, t.cpu(), t.to("cpu")  # not reads (a host tensor's copy to the host is a no-op)
    assert mode.count == 7


def test_the_counter_sees_the_calls_that_wait_for_values():
    """Besides reads into Python: results sized by the values, boolean-mask indexing, ``where`` with the condition
    alone, ``repeat_interleave`` with tensor repeats (``Transfers`` counts the same calls, made from our package);
    not integer indexing, a three-argument ``where``, a sized ``repeat_interleave`` or arithmetic."""
    t, mask = torch.arange(6), torch.arange(6) % 2 == 0
    with HostReads() as mode:
        t.nonzero(), torch.unique(t), t[mask], torch.masked_select(t, mask), torch.where(mask)
        t.clone().index_put_((mask,), t[:3]), torch.repeat_interleave(t, t), t.bincount()
        t[torch.tensor([0, 2])], torch.where(mask, t, 0), t.repeat_interleave(t, output_size=15), t + 1
    assert mode.count == 8


def _decided_store(shared: bool, requests: int = 3, layers: int = 2):
    """A store (or a shared one: the radix cache's) with ``requests`` prompts appended, scored and decided, and a
    decode token appended to each: the next call is the step end's decode decision."""
    heads = 2
    kwargs = {"slots": 64} if shared else {}
    store = (SharedRaggedStore if shared else RaggedStore)(20000, layers, heads, 8, rows=requests, width=8, **kwargs)
    rows = list(range(requests))
    prompts = [20 + 7 * r for r in rows]
    new = store.append(rows, prompts)
    if shared:  # the prompts' tokens recorded (the radix cache's), so decisions turn some entries soft
        store.record(rows, prompts, torch.arange(sum(prompts)), new)
    store.scores.normal_(generator=torch.Generator().manual_seed(requests * 10 + layers))
    return store, rows


@pytest.mark.parametrize("shared", [False, True], ids=["radix-off", "radix-on"])
def test_decisions_and_releases_make_no_host_read(shared):
    """The step end's decisions (the prompts', then 12 decode steps') and a release run on the device alone: no read
    into Python, no call that waits for values (on a GPU, a stall), whatever the batch; one upload each. The host
    learns the results from the snapshot the next call applies: the free count is then the device's."""
    for requests, layers in ((1, 1), (3, 2), (6, 3)):
        store, rows = _decided_store(shared, requests, layers)
        with Transfers() as prompt:
            freed = store.decide_prefill(rows, 0.0, window=4)
        assert (prompt.reads, prompt.moves) == (0, 1)
        freed_total = int(freed)
        for _ in range(12):
            store.append(rows, [1] * len(rows))
            with Transfers() as decode:
                freed = store.decide_decode(rows, 0.0, window=4)
            assert (decode.reads, decode.moves) == (0, 1), (requests, layers)
            freed_total += int(freed)
        assert 0 < freed_total
        soft = store.soft if shared else 0
        assert store.available + soft == int(store.top) + int(store.soft_counter)  # the host learnt the device's counts
        assert store.held - soft == int(store.lengths.sum())
        with Transfers() as release:
            count = store.release(rows[0])
        # radix off: the count the host knows, its mirror's sum (a host tensor: no device read, no wait)
        assert (release.reads, release.moves) == ((0, 0) if shared else (1, 0)) and (count is None) == shared
        assert store.held - (store.soft if shared else 0) == int(store.lengths.sum())


@pytest.mark.parametrize("late", [False, True], ids=["copies-at-once", "copies-late"])
def test_records_their_ends_and_adoptions_read_the_device_at_most_once(late):
    """Radix cache on: a prefill step end's records (given the engine's bound of its slot ids) and the engine letting go
    of slots (a finished request, an eviction) make no read; the adoptions of a batch make one. An end of records runs
    on the device alone, like a decision: until the host's snapshot arrives (``late``: a GPU's, simulated) its free
    count is a lower bound and the room (free + soft) exact."""
    layers, heads = 3, 2
    store = SharedRaggedStore(20000, layers, heads, 8, rows=4, width=8, slots=16)
    store.mirror.held_copies = late
    rows, prompts = [0, 1, 2], [20, 27, 34]
    new = store.append(rows, prompts)
    with Transfers() as record:  # row 2 is never cached: its tokens are left out (one upload of the kept positions)
        assert store.record(rows, prompts, torch.arange(1, 82), new, exclude={2}, slots_below=200) == 47
    assert (record.reads, store.slot_count) == (0, 200)
    store.scores.normal_(generator=torch.Generator().manual_seed(3))
    store.decide_prefill(rows, 0.0, window=4)
    store.release(0)
    store.exact()
    room, soft = store.available + store.soft, store.soft
    assert soft > 0
    with Transfers() as ending:
        store.drop_records(torch.arange(1, 21))  # row 0's slots
    assert ending.reads == 0
    assert store.available + store.soft == room and (store.available == room - soft) == late
    store.exact()
    freed = room - store.available
    assert 0 < store.soft < soft and freed == store.soft  # the records' soft entries are free now
    reads = []
    for adopting in ([3], [3, 4, 5, 6]):  # new requests on row 1's cached prompt, its first 40 - 3 · i tokens
        with Transfers() as adoption, StoreReads() as own:
            store.adopt_all({r: torch.arange(21, 41 - 3 * i) for i, r in enumerate(adopting)})
        assert own.reads == 1  # the store's own: one read of the device for the batch
        reads.append(adoption.reads)
        store.exact()
        held = int((store.rowref[: store.capacity] > 0).sum())
        assert store.available + store.soft + held == store.capacity
        for r in adopting:
            store.release(r)
        store.exact()  # (applying the releases' snapshot reads host memory: not part of the adoption)
    # the rest: host reads of the row tables' capacities (no more for more rows)
    assert reads[0] == reads[1] <= 8, reads


class StoreReads(Transfers):
    """``Transfers``' reads made by ``ragged_shared.py`` itself (the row tables read host tensors only)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if sys._getframe(1).f_code.co_filename.endswith("ragged_shared.py") and syncs(func, args, kwargs):
            self.reads += 1
        return func(*args, **kwargs)


def one_decode_step(layers: int, requests: int, grouped: list | None = None) -> int:
    """Prompts of different lengths decided, then one decode step; returns the reads that step made. ``grouped``: a
    list to append each layer's (output, output without the step's row groups, groups) to."""
    from kvzap_export.integrations.sglang.ragged_rows import StoreRows, build_step

    heads, dim, group = 2, 8, 2
    g = torch.Generator().manual_seed(layers * 100 + requests)
    store = RaggedStore(20000, layers, heads, dim, rows=requests + 2, width=8)
    aux = StoreRows(store, 1000)
    rows = list(range(1, requests + 1))
    prompts = [20 + 7 * r for r in rows]
    aux.alloc_to_lengths(req_pool_indices_cpu=torch.tensor(rows), target_seq_lens_cpu=torch.tensor(prompts))
    aux.take_plan(prompts)
    store.scores.normal_(generator=g)
    store.decide_prefill(rows, 0.0, window=4)
    with HostReads() as mode:
        aux.alloc_to_lengths(req_pool_indices_cpu=torch.tensor(rows), target_seq_lens_cpu=torch.tensor(prompts) + 1)
        plan_rows, counts, new_ids = aux.take_plan((torch.tensor(prompts) + 1).tolist())
        step = build_step(store, plan_rows, counts, new_ids, extend=False)
        q = torch.randn(requests, heads * group, dim, generator=g)
        for layer in range(layers):
            ids = step.new_ids[layer].T.reshape(-1)
            store.k.index_copy_(0, ids, torch.randn(ids.shape[0], dim, generator=g))
            store.v.index_copy_(0, ids, torch.randn(ids.shape[0], dim, generator=g))
            store.scores.index_copy_(0, ids, torch.randn(ids.shape[0], generator=g))
            ids = store.layer_ids(step.slots, layer, step.widths[layer])
            groups = step.groups[layer] if step.groups else None
            out = decode_attention(q, store.k, store.v, ids, step.lengths[:, layer], 0.3, groups=groups)
            if grouped is not None:
                grouped.append((out, decode_attention(q, store.k, store.v, ids, step.lengths[:, layer], 0.3), groups))
        store.decide_decode(rows, 0.0, window=4)
    return mode.count


def test_a_ragged_decode_step_reads_a_constant_number_of_values():
    counts = {(layers, requests): one_decode_step(layers, requests) for layers in (1, 4, 9) for requests in (1, 3, 8)}
    assert len(set(counts.values())) == 1, counts
    assert next(iter(counts.values())) <= 9  # a handful per step: the host mirror's widths, the decisions' lengths


def test_a_decode_step_with_rows_grouped_by_length_attends_as_one_padded_call(monkeypatch):
    """The step's row groups (``build_step`` from the host mirror, forced to split: no cost per call) give each layer
    the attention of one padded call, with no more reads than a step without groups."""
    from kvzap_export.kernels import ragged_attention

    plain = one_decode_step(4, 8)
    monkeypatch.setattr(ragged_attention, "CALL_ENTRIES", 0)
    layers = []
    assert one_decode_step(4, 8, layers) == plain
    assert any(groups is not None for _, _, groups in layers)  # the decided rows are of unequal lengths
    for out, padded, _ in layers:
        assert torch.allclose(out, padded, atol=1e-6)
