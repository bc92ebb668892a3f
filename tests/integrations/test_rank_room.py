"""``RankRoom``: one figure of room shared by tensor-parallel ranks, the least of theirs, between agreements lowered
by what every rank's engine takes alike. Two real processes over gloo, as SGLang's ranks are."""

from __future__ import annotations

import json
import random

import pytest
import torch.multiprocessing as mp

from kvzap_export.integrations.rank_room import RankRoom


def test_one_rank_reports_its_own_figures_and_never_communicates():
    room = RankRoom(None, start=100)
    assert not room.shared
    room.charge(30)
    assert room.room(55) == 55 and room.free(40) == 40
    room.start(1, 2)
    room.agree(1, 2)
    assert room.most(7) == 7 and room.agreements == 0


def _ranks(rank: int, init: str, out: str, seed: int) -> None:
    """One rank of a scripted engine: a pool of 1,000 tokens, allocations the same on both ranks, frees that differ
    (rank 1 frees a third of what rank 0 frees), an agreement started at each step end and installed at the next."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    rng = random.Random(seed)  # the same script on both ranks: the engine's own events are the same
    room = RankRoom(dist.group.WORLD, start=1000)
    local = 1000  # this rank's true free tokens
    seen = []
    for step in range(300):
        n = rng.randint(0, 12)
        if room.room(0) >= n:  # admission on the shared figure
            room.charge(n)
            local -= n
            assert local >= 0, f"rank {rank} ran out at step {step}"
        if step % 7 == 0:  # a prefix set aside for an admission that then ends without taking it
            room.charge(5, free=False)
            seen_aside = room.room(0)
            room.refund(5)
            assert room.room(0) == seen_aside + 5
        freed = rng.randint(0, 10)
        local += freed if rank == 0 else freed // 3
        seen.append([room.room(0), local])
        if step % 50 == 49:  # the slow path: a blocking agreement at a point both ranks reach
            room.agree(local, local)
        else:
            room.start(local, local)
    room.settle()
    short = room.agree_short(local, local, 3 * rank)  # the most any rank is short of, and an agreement
    seen.append([room.room(0), local, room.most(rank * 10), room.agreements, room.blocking, short])
    with open(out, "w") as fh:
        json.dump(seen, fh)
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_see_one_figure_never_above_either_ranks_own(tmp_path):
    """Both ranks read the same figure at every step, it is never above the rank that freed less (a max-over-ranks or
    rank-0-only rule breaks both), a blocking agreement catches up with the frees, and ``most`` is the larger value."""
    init = f"file://{tmp_path / 'rendezvous'}"
    outs = [str(tmp_path / f"rank{r}.json") for r in range(2)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_ranks, args=(r, init, outs[r], 0)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    zero, one = (json.loads(open(o).read()) for o in outs)
    assert [s[0] for s in zero] == [s[0] for s in one]  # one figure on both ranks, at every step
    assert all(s[0] <= min(a[1], b[1]) for s, a, b in zip(zero, zero, one))  # never above either rank's own
    assert zero[-2][1] > one[-2][1]  # rank 0 freed more: the figure followed rank 1
    assert zero[-1][2] == one[-1][2] == 10  # most(): the larger of 0 and 10
    assert zero[-1][3] == one[-1][3] >= 300 and zero[-1][4] == 7  # every agreement installed, 7 of them blocking
    assert zero[-1][5] == one[-1][5] == 3 and zero[-1][0] == min(zero[-1][1], one[-1][1])  # agree_short: 3, exact
    # frees count one agreement late: the figure trails rank 1's own (the lesser) by at most two steps' frees (3 each)
    assert max(min(a[1], b[1]) - a[0] for a, b in zip(zero[:-1], one[:-1])) <= 6
