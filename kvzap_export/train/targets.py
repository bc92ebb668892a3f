"""KVzip+ targets, as kvpress's training pipeline defines them.

Prompt: chat template, user = text + "\\n\\nRepeat the previous context exactly.", assistant = text.
For query head h, query j in the repeated copy and key i in the original text::

    s[h, j, i] = A[h, j, i] * ||W_O^(h) v_i|| / ||x_j||

with A the softmax attention, W_O^(h) head h's slice of o_proj, v_i the value (of h's KV head) and
x_j the post-input-RMSNorm hidden state of query j. Target = log of the max over j, then over the
query heads of each KV group: (n_original_tokens, num_kv_heads) per layer. Features are the
post-norm hidden states of the original tokens.

:func:`kvzip_scores` is the formula on a full attention matrix (as an eager model exposes it).
:func:`layer_targets` computes the same numbers without materialising any attention matrix the
formula does not read: the model runs with SDPA, and for each layer only the rows of the repeated
copy are scored, in the log domain (``log A = logit - logsumexp``; the max over j commutes with the
per-key factor ``||W_O^(h) v_i||``), and the LM head is skipped. On SmolLM2-135M with 1,000-token
texts that is several times faster than an eager forward with ``output_attentions``; the tests
compare it with the eager model's own attention probabilities.
"""

from __future__ import annotations

import contextlib
import math
import threading

import torch

REPEAT_INSTRUCTION = "\n\nRepeat the previous context exactly."
ATTENTION_NAME = "kvzap_kvzip_targets"


def kvzip_scores(attn: torch.Tensor, values: torch.Tensor, o_weight: torch.Tensor, hidden: torch.Tensor,
                 keys: slice, queries: slice, num_kv_heads: int) -> torch.Tensor:
    """One layer's log KVzip+ scores from a full attention matrix.

    attn: (H, T, T) softmax probabilities; values: (T, H_kv, D); o_weight: (hidden, H*D);
    hidden: (T, hidden) attention input; keys / queries: token spans. Returns (n_keys, H_kv).
    """
    heads = attn.shape[0]
    group = heads // num_kv_heads
    v = values[keys].float().repeat_interleave(group, dim=1)  # (n_keys, H, D)
    out_norm = _out_norms(o_weight, v.transpose(0, 1))  # (H, n_keys): ||W_O^(h) v_i||
    x_norm = hidden[queries].float().norm(dim=-1)  # (n_queries,)
    a = attn[:, queries, keys].float()  # (H, n_queries, n_keys)
    s = a * out_norm[:, None, :] / x_norm[None, :, None]
    per_head = s.amax(dim=1)  # max over queries j: (H, n_keys)
    per_group = per_head.view(num_kv_heads, group, -1).amax(dim=1)  # max over the GQA group
    return per_group.clamp_min(torch.finfo(torch.float32).tiny).log().T  # (n_keys, H_kv)


def _out_norms(o_weight: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """||W_O^(h) v_i|| for v: (H, n, D) -> (H, n)."""
    heads, _, head_dim = v.shape
    w_o = o_weight.float().view(o_weight.shape[0], heads, head_dim)  # (hidden, H, D)
    return torch.einsum("ohd,hkd->hko", w_o, v.float()).norm(dim=-1)


def log_scores_from_qk(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, o_weight: torch.Tensor,
                       hidden: torch.Tensor, keys: slice, queries: slice, scaling: float,
                       mask: torch.Tensor | None = None, lse: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's log KVzip+ scores from post-RoPE queries and keys, reading only the rows it needs.

    query: (H, T, D); key, value: (H_kv, T, D); hidden: (T, hidden); mask: None (causal) or the
    layer's (T, T) mask (bool: True = attend; float: additive); lse: (H, T) log-sum-exp of each
    query's scaled logits over the keys it attends to, when the attention kernel already computed
    it (then only the block of repeated queries x original keys is multiplied; the keys must precede
    the queries). Returns (n_keys, H_kv).
    """
    heads, num_kv = query.shape[0], key.shape[0]
    group = heads // num_kv
    q = query[:, queries].float()  # (H, n_q, D)
    log_x = hidden[queries].float().norm(dim=-1).log()  # (n_q,)
    if lse is None:
        stop = queries.stop
        k = key[:, :stop].float().repeat_interleave(group, dim=0)  # (H, stop, D)
        logits = torch.matmul(q, k.transpose(1, 2)) * scaling  # (H, n_q, stop)
        if mask is None:
            rows = torch.arange(queries.start, stop, device=logits.device)[:, None]
            logits.masked_fill_(torch.arange(stop, device=logits.device)[None, :] > rows, -math.inf)
        elif mask.dtype == torch.bool:
            logits.masked_fill_(~mask[queries, :stop], -math.inf)
        else:
            logits += mask[queries, :stop].float()
        lse_q = torch.logsumexp(logits, dim=-1)  # (H, n_q)
        block = logits[:, :, keys] - (lse_q + log_x)[:, :, None]
    else:
        if keys.stop > queries.start:
            raise ValueError("the kernel's log-sum-exp path needs the scored keys before the queries")
        k = key[:, keys].float().repeat_interleave(group, dim=0)  # (H, n_keys, D)
        shift = -(lse[:, queries].float() + log_x)[:, :, None]  # (H, n_q, 1)
        block = torch.baddbmm(shift.expand(-1, -1, k.shape[1]), q, k.transpose(1, 2), alpha=scaling)
    best = block.amax(dim=1)  # (H, n_keys): max over the queries j of log(A / ||x_j||)
    v = value[:, keys].float().repeat_interleave(group, dim=0)  # (H, n_keys, D)
    per_head = best + _out_norms(o_weight, v).clamp_min(torch.finfo(torch.float32).tiny).log()
    floor = math.log(torch.finfo(torch.float32).tiny)
    return per_head.view(num_kv, group, -1).amax(dim=1).clamp_min(floor).T  # (n_keys, H_kv)


def _attention_with_lse(query, key, value, scaling):
    """Causal attention for one sequence (B = 1) and each query's log-sum-exp, from one CPU flash kernel.

    Returns ``(output (1, T, H, D), lse (H, T))``, or ``None`` where the kernel is unavailable (other
    devices, other torch builds): the caller then computes the log-sum-exp itself.
    """
    kernel = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if kernel is None or query.device.type != "cpu" or query.dtype != torch.float32:
        return None
    group = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    output, lse = kernel(query, k, v, 0.0, True, attn_mask=None, scale=scaling)[:2]
    return output.transpose(1, 2).contiguous(), lse[0]


def chat_ids(tokenizer, text: str) -> tuple[torch.Tensor, slice, slice]:
    """Token ids of the repeat prompt and the token spans of the original text and of its copy."""
    messages = [{"role": "user", "content": text + REPEAT_INSTRUCTION}, {"role": "assistant", "content": text}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    if rendered.count(text) < 2:  # templates that trim the content (Llama 3's, Qwen3's last turn): score the trimmed text
        text = text.strip()
    first = rendered.find(text)
    second = rendered.find(text, first + len(text)) if first >= 0 else -1
    if second < 0:
        raise ValueError("the model's chat template does not keep the text verbatim in both turns; the repeat prompt "
                         "cannot locate the original and the copy")
    enc = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]

    def span(start: int, end: int) -> slice:
        idx = [i for i, (a, b) in enumerate(offsets) if a < end and b > start]
        return slice(idx[0], idx[-1] + 1)

    return torch.tensor([enc["input_ids"]]), span(first, first + len(text)), span(second, second + len(text))


_scoring = threading.local()  # the active layer_targets call of this thread (its spans and result dicts)


def _scoring_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The layer's attention output (SDPA), scoring the layer on the side when a layer_targets call is active."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    state = getattr(_scoring, "state", None)
    if state is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    idx = module.layer_idx
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    fused = _attention_with_lse(query, key, value, scale) if attention_mask is None and not module.training else None
    mask = None if attention_mask is None else attention_mask[0, 0]
    state["targets"][idx] = log_scores_from_qk(query[0], key[0], value[0], module.o_proj.weight, state["inputs"].pop(idx),
                                               state["keys"], state["queries"], scale, mask,
                                               lse=None if fused is None else fused[1])
    if fused is not None:
        return fused[0], None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


@contextlib.contextmanager
def _scoring_attention_installed(model):
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, _scoring_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def layer_targets(model, tokenizer, text: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the repeat prompt once; returns features (n, L, D) and targets (n, L, H_kv) of the original text."""
    from kvzap_export.llm import decoder_layers

    ids, original, repeated = chat_ids(tokenizer, text)
    layers = decoder_layers(model)
    state = {"inputs": {}, "targets": {}, "keys": original, "queries": repeated}
    features, handles = {}, []

    def pre_hook(idx):
        def hook(module, args, kwargs):
            hidden = kwargs["hidden_states"][0].detach()
            state["inputs"][idx] = hidden
            features[idx] = hidden[original].clone()
        return hook

    try:
        for idx, layer in enumerate(layers):
            handles.append(layer.self_attn.register_forward_pre_hook(pre_hook(idx), with_kwargs=True))
        _scoring.state = state
        with _scoring_attention_installed(model), torch.no_grad():
            model.base_model(input_ids=ids, use_cache=False)  # the LM head is not needed
    finally:
        _scoring.state = None
        for handle in handles:
            handle.remove()
    missing = [i for i in range(len(layers)) if i not in state["targets"]]
    if missing:
        raise RuntimeError(f"layers {missing} were not scored: their attention does not go through transformers' "
                           "attention interface (Llama/Qwen/Mistral-style models do)")
    order = range(len(layers))
    return torch.stack([features[i] for i in order], dim=1), torch.stack([state["targets"][i] for i in order], dim=1)
