"""``SlotRecords``: engine slots' records in a table the pool bounds, indexed by slot id (no engine)."""

from __future__ import annotations

import logging

import torch

from kvzap_export.integrations.host_reads import Transfers
from kvzap_export.integrations.slot_records import SlotRecords

L, H = 2, 3


def ids_for(first: int, n: int) -> torch.Tensor:
    return torch.arange(first, first + n * L * H, dtype=torch.int32).view(n, L, H)


def test_records_come_and_go_in_a_fixed_table_whatever_the_slot_ids():
    rec = SlotRecords(4, 8, L, H, torch.device("cpu"))
    rec.ensure(1000)
    assert rec.slot_count >= 1000 and rec.entries.shape == (5, L, H)
    for round_ in range(50):  # far more records over time than rows: rows come back on the free stack
        slots = torch.tensor([10 * round_ + 3, 10 * round_ + 7, 999 - round_])
        rec.add(slots, ids_for(100 * round_, 3))
        safe = rec.in_tables(slots)
        assert rec.has(safe).all() and torch.equal(rec.ids(safe), ids_for(100 * round_, 3))
        ends = torch.tensor([True, True, False])
        gone = rec.end(safe, ends)
        assert torch.equal(gone[:2], ids_for(100 * round_, 2).reshape(2, -1).to(torch.int64))
        assert rec.has(safe).tolist() == [False, False, True]
        rec.end(safe[2:], torch.tensor([True]))
        assert not rec.has(safe).any() and int(rec.top) == 4
    assert rec.recorded_slots().numel() == 0


def test_a_full_table_reuses_exactly_the_rows_its_ended_records_gave_back():
    rec = SlotRecords(3, 4, L, H, torch.device("cpu"))
    rec.add(torch.tensor([1, 2, 3]), ids_for(0, 3))
    assert int(rec.top) == 0 and rec.recorded_slots().tolist() == [1, 2, 3]
    rec.end(rec.in_tables(torch.tensor([2])), torch.tensor([True]))
    rec.add(torch.tensor([4]), ids_for(500, 1))
    safe = rec.in_tables(torch.tensor([1, 2, 3, 4]))
    assert rec.has(safe).tolist() == [True, False, True, True]
    assert torch.equal(rec.ids(safe[[0, 2, 3]]), torch.cat([ids_for(0, 1), ids_for(12, 1), ids_for(500, 1)]))


def test_ids_outside_the_index_read_the_sink_and_hold_no_record():
    rec = SlotRecords(2, 4, L, H, torch.device("cpu"))
    safe = rec.in_tables(torch.tensor([-1, 4, 99, 0]))
    assert safe.tolist() == [4, 4, 4, 0] and not rec.has(safe).any()


def test_adding_and_ending_records_read_nothing_back():
    rec = SlotRecords(8, 16, L, H, torch.device("cpu"))
    with Transfers() as seen:
        rec.add(torch.tensor([1, 5, 9]), ids_for(0, 3))
        safe = rec.in_tables(torch.tensor([5, 9, 9, 12]))
        rec.end(safe, torch.tensor([True, True, False, False]))
    assert seen.reads == 0


def test_the_index_growing_past_its_reservation_is_logged_once(caplog):
    rec = SlotRecords(2, 4, L, H, torch.device("cpu"))
    rec.reserve = 10
    rec.add(torch.tensor([3]), ids_for(0, 1))
    with caplog.at_level(logging.WARNING, logger="kvzap_export.integrations.slot_records"):
        rec.ensure(8)  # inside the reservation: grown, never past it
        rec.ensure(10)
        assert rec.slot_count == 10 and not [r for r in caplog.records if "reservation" in r.getMessage()]
        rec.ensure(30)
        rec.ensure(100)
    warned = [r for r in caplog.records if "reservation" in r.getMessage()]
    assert len(warned) == 1 and rec.slot_count >= 100
    assert rec.has(rec.in_tables(torch.tensor([3]))).all()  # growth keeps the records
