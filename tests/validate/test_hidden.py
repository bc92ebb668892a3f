"""Real hidden states, and the prefill the model level reuses from their capture (``captured_prefix``)."""

import pytest

pytest.importorskip("transformers", reason="real hidden states need transformers (the model extra)")

import torch  # noqa: E402

from kvzap_export.cli.main import main  # noqa: E402
from kvzap_export.validate import hidden  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("hidden") / "tiny-qwen3"
    assert main(["export-model", "tiny-qwen3", "--out", str(out)]) == 0
    return str(out)


def test_a_captured_prefix_is_what_a_forward_of_the_prefix_computes(tiny):
    from transformers import DynamicCache

    from kvzap_export.llm import capture_final_hidden, capture_hidden_states, load_llm

    states = hidden.real_hidden_states(tiny, texts=2, tokens=48)
    assert states.source == "real" and states.tokens() == 96
    ids = hidden._LATEST[tiny][1].ids[:30]  # the second text's first 30 tokens
    prefix = hidden.captured_prefix(tiny, ids)
    assert prefix is not None and torch.equal(prefix.ids, ids)
    llm, _ = load_llm(tiny, dtype="float32")
    cache = DynamicCache()
    with torch.no_grad(), capture_hidden_states(llm) as captured, capture_final_hidden(llm) as final:
        logits = llm(input_ids=ids[None], past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    for layer, own in enumerate(cache.layers):
        torch.testing.assert_close(prefix.keys[layer], own.keys[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(prefix.values[layer], own.values[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(prefix.states[layer], captured[layer][0], rtol=0, atol=1e-5)
    torch.testing.assert_close(prefix.final, final[0][0], rtol=0, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(llm.lm_head(prefix.final[-1:]), logits[0], rtol=0, atol=1e-4)
    assert hidden.captured_prefix(tiny, torch.cat([ids[:-1], ids[-1:] + 1])) is None  # begins no captured text
    first = hidden._LATEST[tiny][0].ids
    assert hidden.captured_prefix(tiny, torch.cat([first, first[:1]])) is None  # longer than the text


def test_a_model_whose_logits_are_more_than_its_head_on_the_final_norm_is_not_reused(tiny):
    from kvzap_export.llm import load_llm

    llm, _ = load_llm(tiny, dtype="float32")

    def scale(_module, _args, out):  # as Granite's and Cohere's forwards do after the LM head
        out.logits.mul_(0.5)

    scaled = llm.register_forward_hook(scale)
    try:
        hidden.real_hidden_states(tiny, texts=2, tokens=40)
    finally:
        scaled.remove()
    assert all(text.final is None and text.keys == () for text in hidden._LATEST[tiny])
    assert hidden.captured_prefix(tiny, hidden._LATEST[tiny][0].ids[:20]) is None
