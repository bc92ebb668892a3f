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


def test_kvpress_run_of_a_batch_equals_each_prompt_alone(setup):
    from kvzap_export.validate.model_level import generate_kvpress

    llm, bundle, manifest, prompts = setup
    both = generate_kvpress(llm, torch.cat(prompts), bundle, manifest, NEW_TOKENS)
    for row, ids in enumerate(prompts):
        alone = generate_kvpress(llm, ids, bundle, manifest, NEW_TOKENS)
        assert torch.equal(both.tokens[row], alone.tokens[0])
        assert both.masked[row] == alone.masked[0] > 0  # masked entries counted per sequence
        torch.testing.assert_close(both.logits[row], alone.logits[0], rtol=0, atol=1e-4)
