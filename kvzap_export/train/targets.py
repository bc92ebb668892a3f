"""KVzip+ targets, as kvpress's training pipeline defines them.

Prompt: chat template, user = text + "\\n\\nRepeat the previous context exactly.", assistant = text.
For query head h, query j in the repeated copy and key i in the original text::

    s[h, j, i] = A[h, j, i] * ||W_O^(h) v_i|| / ||x_j||

with A the softmax attention, W_O^(h) head h's slice of o_proj, v_i the value (of h's KV head) and
x_j the post-input-RMSNorm hidden state of query j. Target = log of the max over j, then over the
query heads of each KV group: (n_original_tokens, num_kv_heads) per layer. Features are the
post-norm hidden states of the original tokens.
"""

from __future__ import annotations

import torch

REPEAT_INSTRUCTION = "\n\nRepeat the previous context exactly."


def kvzip_scores(attn: torch.Tensor, values: torch.Tensor, o_weight: torch.Tensor, hidden: torch.Tensor,
                 keys: slice, queries: slice, num_kv_heads: int) -> torch.Tensor:
    """One layer's log KVzip+ scores.

    attn: (H, T, T) softmax probabilities; values: (T, H_kv, D); o_weight: (hidden, H*D);
    hidden: (T, hidden) attention input; keys / queries: token spans. Returns (n_keys, H_kv).
    """
    heads = attn.shape[0]
    head_dim = values.shape[-1]
    group = heads // num_kv_heads
    w_o = o_weight.float().view(o_weight.shape[0], heads, head_dim)  # (hidden, H, D)
    v = values[keys].float().repeat_interleave(group, dim=1)  # (n_keys, H, D)
    out_norm = torch.einsum("ohd,khd->hko", w_o, v).norm(dim=-1)  # (H, n_keys): ||W_O^(h) v_i||
    x_norm = hidden[queries].float().norm(dim=-1)  # (n_queries,)
    a = attn[:, queries, keys].float()  # (H, n_queries, n_keys)
    s = a * out_norm[:, None, :] / x_norm[None, :, None]
    per_head = s.amax(dim=1)  # max over queries j: (H, n_keys)
    per_group = per_head.view(num_kv_heads, group, -1).amax(dim=1)  # max over the GQA group
    return per_group.clamp_min(torch.finfo(torch.float32).tiny).log().T  # (n_keys, H_kv)


def chat_ids(tokenizer, text: str) -> tuple[torch.Tensor, slice, slice]:
    """Token ids of the repeat prompt and the token spans of the original text and of its copy."""
    messages = [{"role": "user", "content": text + REPEAT_INSTRUCTION}, {"role": "assistant", "content": text}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    first = rendered.index(text)
    second = rendered.index(text, first + len(text))
    enc = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]

    def span(start: int, end: int) -> slice:
        idx = [i for i, (a, b) in enumerate(offsets) if a < end and b > start]
        return slice(idx[0], idx[-1] + 1)

    return torch.tensor([enc["input_ids"]]), span(first, first + len(text)), span(second, second + len(text))


def layer_targets(model, tokenizer, text: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the repeat prompt once; returns features (n, L, D) and targets (n, L, H_kv) of the original text."""
    from kvzap_export.llm import decoder_layers

    ids, original, repeated = chat_ids(tokenizer, text)
    layers = decoder_layers(model)
    num_kv_heads = model.config.num_key_value_heads
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    features, targets, handles = {}, {}, []
    inputs: dict[int, torch.Tensor] = {}
    values: dict[int, torch.Tensor] = {}

    def pre_hook(idx):
        def hook(module, args, kwargs):
            inputs[idx] = kwargs["hidden_states"][0].detach()
        return hook

    def v_hook(idx):
        def hook(module, args, output):
            values[idx] = output[0].detach().view(output.shape[1], num_kv_heads, head_dim)
        return hook

    def attn_hook(idx, layer):
        def hook(module, args, kwargs, output):
            attn = output[1]
            if attn is None:
                raise RuntimeError("attention probabilities unavailable: load the model with attn_implementation='eager'")
            hidden = inputs.pop(idx)
            targets[idx] = kvzip_scores(attn[0].detach(), values.pop(idx), layer.self_attn.o_proj.weight.detach(), hidden,
                                        original, repeated, num_kv_heads)
            features[idx] = hidden[original].clone()
        return hook

    try:
        for idx, layer in enumerate(layers):
            handles.append(layer.self_attn.register_forward_pre_hook(pre_hook(idx), with_kwargs=True))
            handles.append(layer.self_attn.v_proj.register_forward_hook(v_hook(idx)))
            handles.append(layer.self_attn.register_forward_hook(attn_hook(idx, layer), with_kwargs=True))
        with torch.no_grad():
            model(input_ids=ids, output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    order = range(len(layers))
    return torch.stack([features[i] for i in order], dim=1), torch.stack([targets[i] for i in order], dim=1)
