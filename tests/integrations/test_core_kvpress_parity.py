"""The engine core reproduces kvpress's decisions on SmolLM2 (prefill + 64 decode steps).

Same test data as tests/test_kvpress_decision_parity.py (its ``reference_inputs`` fixture and
``kvpress_run``): SmolLM2-135M-Instruct, the seeded kvpress-format MLP surrogate, the 600-token prompt.
One threshold (the 50% quantile of kvpress's scores over the evictable prefix; that test covers three).
Hidden states are captured inside kvpress's run; the core scores them with ``BundleScorer`` (torch, the
engines' scorer) and runs ``RequestState`` transitions: one prefill (or chunks) then one ``decode`` per
generated token. Compared with kvpress ``DMSPress(KVzapPress)``:

- ``decoding=True``: every layer's ``masked_key_indices`` after 64 generated tokens;
- ``decoding=False``: the prompt's masks (kvpress never masks afterwards; the core must not either).

A disagreement counts as *unexplained* when kvpress's score lies further than TOL from τ; the bar is 0.
The uniform layout (one count per request, chunked prefill) must keep exactly the ragged layout's rule
set, and its per-step selections must form TensorRT-LLM's sparse layout (int32, sorted, offsets).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.test_kvpress_decision_parity import NEW_TOKENS, WINDOW, kvpress_run, reference_inputs, tolerance  # noqa: F401

pytestmark = pytest.mark.slow

QUANTILE = 0.5
CHUNKS = (200, 450)  # chunked prefill boundaries for the uniform runs


def kept_reference(masked: list[set], heads: int, total: int) -> torch.Tensor:
    keep = torch.ones(len(masked), heads, total, dtype=torch.bool)
    for layer, triples in enumerate(masked):
        for b, h, t in triples:
            assert b == 0
            keep[layer, h, t] = False
    return keep


def feed(state, scores: torch.Tensor, prompt_len: int, chunks=(), on_step=None) -> None:
    # Tiny tensors: one thread (intra-op threads only add latency when other jobs share the cores).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _feed(state, scores, prompt_len, chunks, on_step)
    finally:
        torch.set_num_threads(threads)


def _feed(state, scores: torch.Tensor, prompt_len: int, chunks, on_step) -> None:
    bounds = [0, *chunks, prompt_len]
    for a, b in zip(bounds[:-1], bounds[1:]):
        d = state.prefill(scores[..., a:b], last=b == prompt_len)
    if on_step:
        on_step(d)
    for t in range(prompt_len, scores.shape[-1]):
        d = state.decode(scores[..., t: t + 1])
        if on_step:
            on_step(d)


def test_core_reproduces_kvpress_decisions(reference_inputs):  # noqa: F811  (the imported fixture, by argument)
    from kvzap_export.integrations.core import KVzapPolicy, RequestState, sparse_layout
    from kvzap_export.integrations.scoring import BundleScorer
    from kvzap_export.surrogate import load_surrogate

    llm, weights, ids = reference_inputs
    prompt_len = ids.shape[1]
    _, _, probe_scores, _ = kvpress_run(llm, weights, ids, threshold=-1e30, decoding=False)
    threshold = float(np.quantile(np.concatenate([s[:, : prompt_len - WINDOW].ravel() for s in probe_scores]), QUANTILE))
    tol = tolerance(threshold)

    masked_dec, hidden, ref_scores, pruned_dec = kvpress_run(llm, weights, ids, threshold, decoding=True)
    masked_pre, _, _, pruned_pre = kvpress_run(llm, weights, ids, threshold, decoding=False)
    total = prompt_len + NEW_TOKENS - 1  # the last generated token is never fed
    scorer = BundleScorer(load_surrogate(weights))
    layers, heads = scorer.num_layers, scorer.num_kv_heads
    with torch.no_grad():
        scores = torch.stack([scorer.score(layer, hidden[layer][0]).T for layer in range(layers)])  # [L, H, T]
    assert scores.shape == (layers, heads, total)
    reference = torch.from_numpy(np.stack(ref_scores))
    score_error = float((scores - reference).abs().max())
    assert score_error < tol

    report = {"threshold": round(threshold, 5), "max_score_error": score_error}
    for decoding, masked, pruned in ((True, masked_dec, pruned_dec), (False, masked_pre, pruned_pre)):
        name = "decoding" if decoding else "prefill_only"
        theirs = kept_reference(masked, heads, total)
        ragged = RequestState(KVzapPolicy(threshold, window=WINDOW, decoding=decoding, layout="ragged"), layers, heads)
        feed(ragged, scores, prompt_len)
        ours = torch.stack([ragged.visible(layer) for layer in range(layers)])
        flips = ours ^ theirs
        unexplained = int((flips & ((reference - threshold).abs() > tol)).sum())
        held = float(ragged.counts.sum()) / (layers * heads * total)
        per_layer = float(ragged.counts.amax(dim=1).sum()) / (layers * total)
        # Freed fractions are of every entry fed (prompt + decode); kvpress's measure is of its last cache.
        report[name] = {"flips": int(flips.sum()), "unexplained": unexplained, "kvpress_pruned": round(pruned, 4),
                        "ragged_freed": round(1 - held, 4), "per_layer_uniform_freed": round(1 - per_layer, 4)}
        assert unexplained == 0, report
        assert 0.2 <= pruned <= 0.8, report

        # Uniform layout, chunked prefill: same rule set, one count per request, TRT-LLM layout every step.
        uniform = RequestState(KVzapPolicy(threshold, window=WINDOW, decoding=decoding), layers, heads)
        steps = []
        feed(uniform, scores, prompt_len, CHUNKS, on_step=lambda d: steps.append(d))
        assert torch.equal(torch.stack([uniform.visible(layer) for layer in range(layers)]), ours)
        assert uniform.num_compressed_tokens == total - uniform.physical_length
        report[name]["uniform_freed"] = round(1 - uniform.physical_length / total, 4)
        for a, b in zip(steps[:-1], steps[1:]):  # consecutive steps stand in for a batch of two requests
            for layer in (0, layers - 1):
                indices, offsets = sparse_layout([a.indices[layer], b.indices[layer]])
                k_a, k_b = a.uniform_count, b.uniform_count
                assert indices.dtype == torch.int32 and offsets.dtype == torch.int32
                assert indices.shape == (heads, k_a + k_b) and offsets.tolist() == [0, k_a, k_a + k_b]
                for s, e in ((0, k_a), (k_a, k_a + k_b)):
                    assert torch.equal(indices[:, s:e], torch.sort(indices[:, s:e], dim=-1).values)
        for d in steps:
            assert bool((d.counts == d.uniform_count).all())
    print(f"\ncore vs kvpress on SmolLM2: {report}")
