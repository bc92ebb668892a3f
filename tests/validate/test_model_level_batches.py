"""The model level runs prompts of equal length as one batch: each sequence's result must be what it gets alone."""

import pytest
import torch

pytestmark = pytest.mark.slow

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from kvzap_export.llm import load_llm
    from kvzap_export.pipeline import ExportOptions, run_pipeline
    from kvzap_export.validate.model_level import held_out_prompts

    bundle = tmp_path_factory.mktemp("batches") / "bundle"
    manifest = run_pipeline(ExportOptions(model="smollm2-135m", out=bundle, check=False))
    llm, tokenizer = load_llm("smollm2-135m")
    prompts = held_out_prompts(tokenizer, 2, 200)  # window 128: 72 positions per head can be evicted
    assert prompts[0].shape == prompts[1].shape and not torch.equal(prompts[0], prompts[1])
    return llm, bundle, manifest, prompts


def test_compacted_run_of_a_batch_equals_each_prompt_alone(setup):
    from kvzap_export.validate.model_level import generate_compacted

    llm, bundle, manifest, prompts = setup
    steps = []
    both = generate_compacted(llm, torch.cat(prompts), bundle, manifest, NEW_TOKENS, on_token=lambda: steps.append(1))
    assert len(steps) == NEW_TOKENS  # one forward per new token
    for row, ids in enumerate(prompts):
        alone = generate_compacted(llm, ids, bundle, manifest, NEW_TOKENS)
        assert torch.equal(both.tokens[row], alone.tokens[0])
        assert all((layer_both[row] == layer_alone[0]).all() for layer_both, layer_alone in zip(both.counts, alone.counts))
        assert (both.held_bytes[row], both.full_bytes[row]) == (alone.held_bytes[0], alone.full_bytes[0])
        torch.testing.assert_close(both.logits[row], alone.logits[0], rtol=0, atol=1e-4)
    assert both.counts[0].shape == (2, manifest["model"]["num_kv_heads"])
    assert both.held_bytes[0] != both.held_bytes[1]  # different prompts keep different entries


def test_a_prefill_taken_from_the_capture_equals_our_own(setup, monkeypatch):
    """Our run reuses the hidden-state capture's forward for a prompt that begins a captured text: a prompt cut from
    a longer text computes the same prefix (attention is causal), so the whole run must be the same, here with one
    prompt reused and one prefilled in the run (a mixed batch)."""
    from kvzap_export.validate import hidden
    from kvzap_export.validate.model_level import generate_compacted

    llm, bundle, manifest, prompts = setup
    # As if the latest validation had captured the first held-out text, 300 tokens: prompts[0] is its first 200.
    monkeypatch.setitem(hidden._LATEST, "smollm2-135m", hidden._capture("smollm2-135m", 1, 300))
    reuse = lambda row: hidden.captured_prefix("smollm2-135m", row)  # noqa: E731
    assert reuse(prompts[0][0]) is not None and reuse(prompts[1][0]) is None
    assert hidden.captured_prefix("another-model", prompts[0][0]) is None
    ids = torch.cat(prompts)
    own = generate_compacted(llm, ids, bundle, manifest, NEW_TOKENS)
    steps = []
    reused = generate_compacted(llm, ids, bundle, manifest, NEW_TOKENS, prefilled=reuse, on_token=lambda: steps.append(1))
    assert (own.prefill_reused, reused.prefill_reused, len(steps)) == (0, 1, NEW_TOKENS)
    assert torch.equal(own.tokens, reused.tokens)
    torch.testing.assert_close(own.logits, reused.logits, rtol=0, atol=1e-4)  # float rounding: other GEMM shapes
    assert all((a == b).all() for a, b in zip(own.counts, reused.counts))
    assert (own.held_bytes, own.full_bytes, own.prompt_len) == (reused.held_bytes, reused.full_bytes, reused.prompt_len)


def test_kvpress_run_of_a_batch_equals_each_prompt_alone(setup):
    from kvzap_export.validate.model_level import generate_kvpress

    llm, bundle, manifest, prompts = setup
    both = generate_kvpress(llm, torch.cat(prompts), bundle, manifest, NEW_TOKENS)
    for row, ids in enumerate(prompts):
        alone = generate_kvpress(llm, ids, bundle, manifest, NEW_TOKENS)
        assert torch.equal(both.tokens[row], alone.tokens[0])
        assert both.masked[row] == alone.masked[0] > 0  # masked entries counted per sequence
        torch.testing.assert_close(both.logits[row], alone.logits[0], rtol=0, atol=1e-4)


def test_runs_side_by_side_on_copies_of_the_model_equal_the_runs_one_after_the_other(setup, monkeypatch):
    from kvzap_export import threads
    from kvzap_export.validate.model_level import generate_compacted, generate_kvpress, model_copies
    from kvzap_export.validate.reference import kvpress_press

    llm, bundle, manifest, prompts = setup
    ids = torch.cat(prompts)
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)  # threads even on a 1-CPU runner
    from transformers import PreTrainedModel

    process_wide = lambda: (dict(vars(torch.nn.init)), torch.get_default_dtype(), PreTrainedModel.init_weights)  # noqa: E731
    before = process_wide()
    models = [llm, *model_copies(llm, 2)]  # as the model level makes them: the weights shared
    presses = [kvpress_press(bundle, manifest, models[1 + d], d) for d in (False, True)]  # made in this thread
    ours, theirs, decoding = threads.side_by_side([
        lambda stop: generate_compacted(models[0], ids, bundle, manifest, NEW_TOKENS, stop=stop),
        lambda stop: generate_kvpress(models[1], ids, bundle, manifest, NEW_TOKENS, False, stop=stop, press=presses[0]),
        lambda stop: generate_kvpress(models[2], ids, bundle, manifest, NEW_TOKENS, True, stop=stop, press=presses[1])])
    assert llm.config._attn_implementation == "sdpa"  # ours restored its model; the copies were never shared
    assert process_wide() == before  # what transformers' from_pretrained swaps was not left swapped by a race
    alone = [generate_compacted(llm, ids, bundle, manifest, NEW_TOKENS),
             generate_kvpress(llm, ids, bundle, manifest, NEW_TOKENS, False),
             generate_kvpress(llm, ids, bundle, manifest, NEW_TOKENS, True)]
    for side, one in zip((ours, theirs, decoding), alone):
        assert torch.equal(side.tokens, one.tokens)
        torch.testing.assert_close(side.logits, one.logits, rtol=0, atol=1e-4)
    assert all((a == b).all() for a, b in zip(ours.counts, alone[0].counts))
    assert (ours.held_bytes, theirs.masked, decoding.masked) == (alone[0].held_bytes, alone[1].masked, alone[2].masked)
    assert decoding.masked != theirs.masked  # decoding=True masks more as the window slides: two different runs
