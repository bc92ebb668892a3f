"""The engine-independent KVzap state against kvpress's decisions on random data (fast)."""

from __future__ import annotations

import pytest
import torch

from kvzap_export.errors import ConfigError, InputError
from kvzap_export.integrations.core import KVzapPolicy, RequestState, budget_selection, context_budget, sparse_layout
from kvzap_export.integrations.scoring import BundleScorer, SlotScores, StepScores, tp_head_range
from tests.helpers import HostReads
from tests.integrations.kvpress_reference import kvpress_masked

L, H = 3, 4


def random_steps(seed: int, prompt: int, decode_steps: int, spec: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    steps = [torch.randn(L, H, prompt, generator=g)]
    for i in range(decode_steps):
        n = 2 if spec and i % 3 == 0 else 1
        steps.append(torch.randn(L, H, n, generator=g))
    return steps


def run(policy: KVzapPolicy, steps: list[torch.Tensor], chunks: list[int] | None = None) -> RequestState:
    state = RequestState(policy, L, H)
    prompt = steps[0]
    bounds = [0, *(chunks or []), prompt.shape[-1]]
    for a, b in zip(bounds[:-1], bounds[1:]):
        state.prefill(prompt[..., a:b], last=b == prompt.shape[-1])
    for new in steps[1:]:
        state.decode(new)
    return state


def visible_all(state: RequestState, exact: bool = True) -> torch.Tensor:
    return torch.stack([state.visible(layer, exact) for layer in range(L)])


CASES = [(seed, prompt, window) for seed, (prompt, window) in enumerate([(0, 4), (3, 4), (4, 4), (5, 4), (40, 0), (40, 8),
                                                                          (57, 16), (130, 128)])]


@pytest.mark.parametrize("layout", ["ragged", "uniform"])
@pytest.mark.parametrize("decoding", [False, True], ids=["prefill_only", "decoding"])
@pytest.mark.parametrize("seed,prompt,window", CASES)
def test_decisions_match_kvpress(seed, prompt, window, decoding, layout):
    steps = random_steps(seed, prompt, decode_steps=12, spec=seed % 2 == 1)
    for threshold in (-0.5, 0.3):
        state = run(KVzapPolicy(threshold, window=window, decoding=decoding, layout=layout), steps)
        expected = ~kvpress_masked(steps, threshold, window, decoding)
        assert torch.equal(visible_all(state), expected)
        # Every physical row is ascending and holds the rule's set (ragged: nothing else).
        for layer in range(L):
            for head in range(H):
                held = state.kept_positions(layer, head, exact=False)
                assert torch.equal(held, torch.sort(held).values) and len(set(held.tolist())) == len(held)
                if layout == "ragged":
                    assert torch.equal(held, state.kept_positions(layer, head))


@pytest.mark.parametrize("layout", ["ragged", "uniform"])
@pytest.mark.parametrize("decoding", [False, True], ids=["prefill_only", "decoding"])
def test_chunked_prefill_equals_one_shot(layout, decoding):
    policy = KVzapPolicy(0.0, window=8, decoding=decoding, layout=layout)
    g = torch.Generator().manual_seed(11)
    for trial in range(6):
        steps = random_steps(100 + trial, prompt=50, decode_steps=5)
        cuts = sorted(torch.randperm(49, generator=g)[: trial + 1].add(1).tolist())
        one, chunked = run(policy, steps), run(policy, steps, chunks=cuts)
        assert torch.equal(visible_all(one), visible_all(chunked)) and torch.equal(one.counts, chunked.counts)
        if layout == "ragged":  # uniform extras may differ: a chunk's padding choice is made before later chunks exist
            held = int(one.counts.max())  # the buffers' width past the longest row is room for appends
            for name in ("positions", "scores", "rule_kept"):
                assert torch.equal(getattr(one, name)[..., :held], getattr(chunked, name)[..., :held]), (name, cuts)
        assert one.logical_length == chunked.logical_length == 55 and chunked.prompt_length == 50


def test_uniform_keeps_rule_set_plus_best_scored_extras():
    steps = random_steps(5, prompt=60, decode_steps=20)
    ragged = RequestState(KVzapPolicy(0.2, window=8, layout="ragged"), L, H)
    uniform = RequestState(KVzapPolicy(0.2, window=8), L, H)
    for i, new in enumerate(steps):
        if i == 0:
            d_r, d_u = ragged.prefill(new), uniform.prefill(new)
        else:
            d_r, d_u = ragged.decode(new), uniform.decode(new)
        # One count per request for every layer and head: the ragged maximum.
        assert torch.all(d_u.counts == d_r.counts.max()) and uniform.physical_length == d_u.uniform_count
        assert uniform.num_compressed_tokens == uniform.logical_length - d_u.uniform_count
        assert torch.equal(visible_all(uniform), visible_all(ragged))
        for layer in range(L):
            for head in range(H):
                held = uniform.kept_positions(layer, head, exact=False)
                assert set(ragged.kept_positions(layer, head).tolist()) <= set(held.tolist())
    assert uniform.physical_length >= ragged.physical_length


def test_decision_drives_engine_moves():
    """An engine applying each Decision to its own cache ends with exactly the state's rows."""
    steps = random_steps(9, prompt=30, decode_steps=15, spec=True)
    for layout in ("ragged", "uniform"):
        state = RequestState(KVzapPolicy(0.0, window=6, layout=layout), L, H)
        cache = torch.empty(L, H, 0, dtype=torch.int64)  # the engine's K/V, here: each entry's logical position
        lengths = torch.zeros(L, H, dtype=torch.int64)
        for i, new in enumerate(steps):
            start = state.logical_length
            n = new.shape[-1]
            rows = [[torch.cat([cache[l, h, : lengths[l, h]], torch.arange(start, start + n)]) for h in range(H)] for l in range(L)]
            d = state.prefill(new) if i == 0 else state.decode(new)
            assert torch.equal(d.physical_before, lengths + n)
            width = int(d.counts.max())
            cache = torch.full((L, H, width), -1, dtype=torch.int64)
            for l in range(L):
                for h in range(H):
                    k = int(d.counts[l, h])
                    cache[l, h, :k] = rows[l][h][d.indices[l, h, :k]]
            lengths = d.counts
            assert torch.equal(cache, state.positions[..., :width])
            assert d.freed == int((d.physical_before - d.counts).sum())


def test_count_override_for_tensor_parallel_agreement():
    state = RequestState(KVzapPolicy(0.5, window=4), L, H)
    state.append(random_steps(3, prompt=40, decode_steps=0)[0])
    state.prompt_length = 40
    proposal = state.propose()
    with pytest.raises(InputError, match="counts"):
        state.commit(proposal, count=proposal.local_count - 1)
    d = state.commit(proposal, count=proposal.local_count + 3)
    assert torch.all(d.counts == proposal.local_count + 3)
    # The rule's set is unchanged by the padding.
    assert int(state.rule_kept.sum()) == int(proposal.keep.sum())


@pytest.mark.parametrize("layout", ["uniform", "ragged"])
def test_a_step_reads_one_value_back_to_the_host(layout):
    """The rule runs on the state's own row lengths without reading them back (on a GPU: no sync per layer per
    step for validation); the one read is the count ``propose`` returns for the engine to agree on."""
    state = RequestState(KVzapPolicy(threshold=0.0, window=4, layout=layout), L, H)
    state.append(torch.randn(L, H, 30, generator=torch.Generator().manual_seed(5)))
    with HostReads() as reads:
        proposal = state.propose()
    assert reads.count == 1 and proposal.local_count == int(proposal.keep.sum(-1).max())


def test_sink_and_nan_are_kept():
    steps = random_steps(2, prompt=40, decode_steps=10)
    steps[0][..., 5] = float("nan")
    state = run(KVzapPolicy(10.0, window=4, sink=3, layout="ragged"), steps)  # τ above every score
    for layer in range(L):
        for head in range(H):
            assert state.kept_positions(layer, head).tolist() == [0, 1, 2, 5, 46, 47, 48, 49]


def test_positions_continue_from_logical_length():
    state = run(KVzapPolicy(0.0, window=4), random_steps(4, prompt=20, decode_steps=3))
    assert state.logical_length == 23 and state.prompt_length == 20
    assert int(state.positions.max()) == 22
    before = state.logical_length
    state.decode(torch.zeros(L, H, 1))
    assert state.positions[0, 0, int(state.counts[0, 0]) - 1] == before


def test_budget_selection_and_sparse_layout():
    policy = KVzapPolicy(0.0, window=4, sink=1)
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(3, H, 30, generator=g)
    lengths = torch.tensor([30, 12, 3])
    budgets = torch.tensor([20, 6, 10])
    sel = budget_selection(scores, lengths, budgets, policy)
    assert sel.counts.tolist() == [20, 6, 3] and sel.indices.dtype == torch.int32
    from kvzap_export.ops import threshold_compaction

    keep = threshold_compaction(scores, lengths, policy.threshold, policy.window, policy.sink).keep
    for b in range(3):
        for h in range(H):
            row = sel.indices[b, h, : sel.counts[b]]
            assert torch.equal(row, torch.sort(row).values) and bool((row < lengths[b]).all())
            kept = set(torch.nonzero(keep[b, h]).flatten().tolist())
            protected = {t for t in range(int(lengths[b])) if t >= lengths[b] - 4 or t < 1}
            assert protected <= set(row.tolist())
            if len(kept) <= sel.counts[b]:
                assert kept <= set(row.tolist())
    indices, offsets = sparse_layout([sel.indices[b, :, : sel.counts[b]] for b in range(3)])
    assert indices.shape == (H, 29) and indices.dtype == torch.int32 and offsets.dtype == torch.int32
    assert offsets.tolist() == [0, 20, 26, 29]
    for b in range(3):
        seg = indices[:, offsets[b]: offsets[b + 1]]
        assert torch.equal(seg, torch.sort(seg, dim=-1).values)
    assert context_budget(1000, 0.3, 128) == 300 and context_budget(200, 0.3, 128) == 128
    assert context_budget(100, 0.3, 128) == 100


def test_errors_are_typed():
    with pytest.raises(ConfigError):
        KVzapPolicy(float("nan"))
    with pytest.raises(ConfigError):
        KVzapPolicy(0.0, layout="paged")
    with pytest.raises(ConfigError, match="window must be an integer in"):  # the GPU rule's bound, refused up front
        KVzapPolicy(0.0, window=(1 << 24) + 1)
    state = RequestState(KVzapPolicy(0.0), L, H)
    with pytest.raises(InputError, match="layers"):
        state.prefill(torch.zeros(L + 1, H, 2))
    with pytest.raises(InputError, match="decode before"):
        state.decode(torch.zeros(L, H, 1))
    state.prefill(torch.zeros(L, H, 2))
    with pytest.raises(InputError, match="prefill after"):
        state.prefill(torch.zeros(L, H, 2))
    with pytest.raises(ConfigError):
        tp_head_range(3, 2, 0)


def test_side_buffers_and_head_ranges():
    assert tp_head_range(8, 4, 1) == (2, 4) and tp_head_range(2, 8, 5) == (1, 2) and tp_head_range(3, 1, 0) == (0, 3)
    slots = SlotScores(L, H)
    slots.ensure(10, torch.float32, "cpu")
    for layer in range(L):
        slots.write(layer, torch.tensor([7, 2]), torch.full((2, H), float(layer)) + torch.tensor([[0.5], [0.25]]))
    slots.ensure(5000, torch.float32, "cpu")  # growth keeps what was written
    out = slots.read(torch.tensor([2, 7]))
    assert out.shape == (L, H, 2) and out[2, 0].tolist() == [2.25, 2.5]
    step = StepScores(2)
    step.write(0, torch.zeros(3, H))
    with pytest.raises(InputError, match="layers"):
        step.take()


def test_bundle_scorer_matches_surrogate_and_slices_heads():
    from kvzap_export.surrogate.model import Surrogate, SurrogateConfig

    torch.manual_seed(0)
    surrogate = Surrogate(SurrogateConfig(16, 4, 2, 8))
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    full = BundleScorer(surrogate)
    assert torch.equal(full.score(1, x), surrogate.score(1, x))
    rank1 = BundleScorer(surrogate, tp_head_range(4, 2, 1))
    assert torch.equal(rank1.score(1, x), surrogate.score(1, x)[:, 2:])


def test_buffers_grow_ahead_by_at_most_grow_ahead(monkeypatch):
    """A long request's buffers take spare room in steps of at most GROW_AHEAD columns, not by doubling (the
    state lives outside the engine's KV budget), and its decisions are the same as with doubling."""
    import kvzap_export.integrations.core as core

    steps = random_steps(7, 40, 60)
    policy = KVzapPolicy(0.0, window=4, layout="ragged")  # about half the entries kept: the rows keep growing
    unbounded = run(policy, steps)
    monkeypatch.setattr(core, "GROW_AHEAD", 3)
    state = RequestState(policy, L, H)
    state.prefill(steps[0])
    for step in steps[1:]:
        before = state.positions.shape[-1]
        state.decode(step)
        assert state.positions.shape[-1] - before <= max(3, step.shape[-1])
    assert state.positions.shape[-1] < unbounded.positions.shape[-1] and int(state.counts.max()) > 30
    assert torch.equal(state.visible_all(), unbounded.visible_all())
