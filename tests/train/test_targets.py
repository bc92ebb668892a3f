"""KVzip+ targets vs a direct loop over the formula on a tiny random Llama."""

import math

import pytest
import torch

from kvzap_export.train.targets import kvzip_scores, layer_targets


class Tok:  # a character-level tokenizer with a chat template, enough for the span logic
    def apply_chat_template(self, messages, tokenize=False):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        return {"input_ids": [ord(c) % 64 for c in text], "offset_mapping": [(i, i + 1) for i in range(len(text))]}


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=256, attn_implementation="eager")
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def loop_reference(attn, values, o_weight, hidden, keys, queries, num_kv_heads):
    heads, head_dim = attn.shape[0], values.shape[-1]
    group = heads // num_kv_heads
    out = torch.empty(len(range(*keys.indices(attn.shape[-1]))), num_kv_heads)
    for ki, i in enumerate(range(*keys.indices(attn.shape[-1]))):
        for g in range(num_kv_heads):
            best = -math.inf
            for h in range(g * group, (g + 1) * group):
                w = o_weight[:, h * head_dim:(h + 1) * head_dim]
                v_norm = float((w @ values[i, g]).norm())
                for j in range(*queries.indices(attn.shape[-1])):
                    best = max(best, float(attn[h, j, i]) * v_norm / float(hidden[j].norm()))
            out[ki, g] = math.log(best)
    return out


def test_vectorized_formula_matches_loops():
    torch.manual_seed(1)
    heads, kv, d, t, hid = 4, 2, 3, 9, 5
    attn = torch.rand(heads, t, t).softmax(-1)
    values, o_weight, hidden = torch.randn(t, kv, d), torch.randn(hid, heads * d), torch.randn(t, hid)
    keys, queries = slice(1, 4), slice(5, 9)
    got = kvzip_scores(attn, values, o_weight, hidden, keys, queries, kv)
    torch.testing.assert_close(got, loop_reference(attn, values, o_weight, hidden, keys, queries, kv), rtol=1e-5, atol=1e-5)


def test_model_targets_match_loops_on_tiny_llama(tiny):
    """Through the real model: attention probabilities, values, o_proj and post-norm inputs from hooks."""

    text = "abcdefghij"
    features, targets = layer_targets(tiny, Tok(), text)
    assert features.shape == (len(text), 2, 32) and targets.shape == (len(text), 2, 2)
    # Independent recomputation from the model's own outputs.
    rendered = Tok().apply_chat_template([{"role": "user", "content": text + "\n\nRepeat the previous context exactly."},
                                          {"role": "assistant", "content": text}])
    ids = torch.tensor([[ord(c) % 64 for c in rendered]])
    first, second = rendered.index(text), rendered.index(text, rendered.index(text) + 1)
    keys, queries = slice(first, first + len(text)), slice(second, second + len(text))
    with torch.no_grad():
        out = tiny(input_ids=ids, output_attentions=True, output_hidden_states=True)
    for layer_idx, layer in enumerate(tiny.model.layers):
        x = layer.input_layernorm(out.hidden_states[layer_idx][0])
        v = layer.self_attn.v_proj(x).view(-1, 2, 8)
        expected = loop_reference(out.attentions[layer_idx][0], v, layer.self_attn.o_proj.weight, x, keys, queries, 2)
        torch.testing.assert_close(targets[:, layer_idx], expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(features[:, layer_idx], x[keys])


def _qk_case(seed=2, heads=4, kv=2, d=8, t=12, hid=6):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(heads, t, d, generator=gen), torch.randn(kv, t, d, generator=gen), torch.randn(kv, t, d, generator=gen)
    o_weight, hidden = torch.randn(hid, heads * d, generator=gen), torch.randn(t, hid, generator=gen)
    return q, k, v, o_weight, hidden


def _probabilities(q, k, scaling, allowed):
    group = q.shape[0] // k.shape[0]
    logits = (q @ k.repeat_interleave(group, 0).transpose(1, 2)) * scaling
    return logits.masked_fill(~allowed, -math.inf).softmax(-1)


@pytest.mark.parametrize("mask_kind", ["causal", "bool", "additive"])
def test_scores_from_queries_and_keys_equal_the_formula_on_softmax_probabilities(mask_kind):
    """The block computation (log domain, only the repeated rows) against kvzip_scores on a full softmax matrix."""
    from kvzap_export.train.targets import log_scores_from_qk

    q, k, v, o_weight, hidden = _qk_case()
    t, scaling = q.shape[1], 0.35
    allowed = torch.ones(t, t, dtype=torch.bool).tril()
    if mask_kind != "causal":
        allowed[:, 0] = False  # a key no query may see (as a sliding window or padding would)
        allowed[0, 0] = True
    mask = {"causal": None, "bool": allowed, "additive": torch.zeros(t, t).masked_fill(~allowed, -math.inf)}[mask_kind]
    keys, queries = slice(1, 5), slice(7, 12)
    got = log_scores_from_qk(q, k, v, o_weight, hidden, keys, queries, scaling, mask)
    expected = kvzip_scores(_probabilities(q, k, scaling, allowed), v.transpose(0, 1), o_weight, hidden, keys, queries, 2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_kernels_log_sum_exp_path_equals_the_explicit_one():
    from kvzap_export.train.targets import _attention_with_lse, log_scores_from_qk

    q, k, v, o_weight, hidden = _qk_case(seed=3)
    fused = _attention_with_lse(q[None], k[None], v[None], 0.35)
    if fused is None:
        pytest.skip("this torch build has no CPU flash-attention kernel returning the log-sum-exp")
    output, lse = fused
    keys, queries = slice(1, 5), slice(7, 12)
    explicit = log_scores_from_qk(q, k, v, o_weight, hidden, keys, queries, 0.35)
    torch.testing.assert_close(log_scores_from_qk(q, k, v, o_weight, hidden, keys, queries, 0.35, lse=lse), explicit,
                               rtol=1e-5, atol=1e-5)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q[None], k.repeat_interleave(2, 0)[None], v.repeat_interleave(2, 0)[None],
                                                            is_causal=True, scale=0.35)
    torch.testing.assert_close(output, sdpa.transpose(1, 2))
    with pytest.raises(ValueError, match="keys before the queries"):
        log_scores_from_qk(q, k, v, o_weight, hidden, slice(1, 9), queries, 0.35, lse=lse)


def test_the_model_is_left_as_it_was(tiny):
    """layer_targets swaps the attention implementation for one forward and restores it, even on error."""

    before = tiny.config._attn_implementation
    layer_targets(tiny, Tok(), "abcdefgh")
    assert tiny.config._attn_implementation == before
    class OutOfVocabulary(Tok):
        def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
            return {**super().__call__(text), "input_ids": [1000] * len(text)}

    with pytest.raises(IndexError):
        layer_targets(tiny, OutOfVocabulary(), "abcdefgh")  # the embedding lookup fails inside the forward
    assert tiny.config._attn_implementation == before
