"""KVzip+ targets vs a direct loop over the formula on a tiny random Llama."""

import math

import pytest
import torch

from kvzap_export.train.targets import kvzip_scores, layer_targets


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

    class Tok:  # a character-level tokenizer with a chat template, enough for the span logic
        def apply_chat_template(self, messages, tokenize=False):
            return "".join(f"<{m['role']}>{m['content']}" for m in messages)

        def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
            return {"input_ids": [ord(c) % 64 for c in text], "offset_mapping": [(i, i + 1) for i in range(len(text))]}

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
