"""Per-layer, per-head masking used by `evaluate`: exact semantics on a tiny random Llama."""

import torch

from kvzap_export.evaluate.masked import layer_masks, prune_bias
from kvzap_export.evaluate.run import _baseline


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, attn_implementation="eager")
    return LlamaForCausalLM(cfg).eval()


def test_no_pruning_is_the_full_model_and_pruning_only_affects_the_continuation():
    llm = _tiny()
    ids = torch.randint(0, 64, (1, 20))
    prompt = 14
    with torch.no_grad():
        full = llm(input_ids=ids).logits
        nothing = {l: prune_bias(torch.zeros(2, prompt, dtype=torch.bool), prompt, 20, 4) for l in range(2)}
        with layer_masks(llm, nothing):
            same = llm(input_ids=ids).logits
        pruned = torch.zeros(2, prompt, dtype=torch.bool)
        pruned[0, 2:6] = True  # KV head 0 only, layer 1 only
        with layer_masks(llm, {1: prune_bias(pruned, prompt, 20, 4)}):
            masked = llm(input_ids=ids).logits
    torch.testing.assert_close(same, full)
    torch.testing.assert_close(masked[:, :prompt], full[:, :prompt])  # prefill stays dense, as kvpress
    assert not torch.allclose(masked[:, prompt:], full[:, prompt:])
    assert llm.config._attn_implementation == "eager"  # restored


def test_bias_masks_the_kv_group_of_each_head():
    pruned = torch.tensor([[True, False, False], [False, False, True]])
    bias = prune_bias(pruned, 3, 5, 4)
    assert bias.shape == (1, 4, 5, 5)
    assert torch.isinf(bias[0, :2, 3:, 0]).all() and not torch.isinf(bias[0, 2:, 3:, 0]).any()
    assert torch.isinf(bias[0, 2:, 3:, 2]).all() and (bias[0, :, 3:, 1] == 0).all()
    assert torch.isinf(bias[0, 0, 0, 1])  # causal


def test_baselines_prune_the_same_count():
    counts = torch.tensor([3, 0, 5])
    gen = torch.Generator().manual_seed(0)
    for kind in ("random", "recent"):
        pruned = _baseline(kind, counts, 10, gen)
        assert pruned.sum(1).tolist() == [3, 0, 5]
    assert _baseline("recent", counts, 10, gen)[2, :5].all()
