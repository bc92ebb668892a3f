"""Mask mode's attention backends: decode attends, per KV head, only to the entries kvpress keeps.

Nothing is freed (SGLang's slots hold every token); the decisions are exact kvpress semantics: the prefill
forward is dense, decisions apply to later forwards. Two backends, registered with SGLang's
``register_attention_backend`` when ``KVZAP_MODE=mask``:

- ``kvzap_native`` (CPU and GPU): SGLang's ``torch_native`` backend whose decode runs scaled-dot-product
  attention per request with a boolean mask ``[q_heads, 1, kv_len]`` built from each KV head's visible set
  (each query head uses its KV head's row: GQA stays exact). Extends stay dense, as in kvpress.
- ``kvzap_flex`` (GPU): SGLang's ``flex_attention`` backend with a per-layer, per-head ``mask_mod``.
  flex_attention is not run on the CPU here (see docs/integrations.md); its masks are checked against
  per-head masked attention on the CPU (tests/integrations/sglang/test_masking.py).
"""

from __future__ import annotations

import torch

from kvzap_export.integrations.sglang.api import sglang_module

NATIVE_BACKEND = "kvzap_native"
FLEX_BACKEND = "kvzap_flex"
BACKENDS = (NATIVE_BACKEND, FLEX_BACKEND)


def visibility_mask_mod(visible: torch.Tensor, group: int):
    """flex-attention ``mask_mod(b, h, q_idx, kv_idx)`` for one request and layer.

    visible: bool [kv_heads, kv_len]; ``h`` is the query head, ``h // group`` its KV head (GQA).
    """

    def mask_mod(b, h, q_idx, kv_idx):
        return visible[h // group, kv_idx]

    return mask_mod


def masked_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: list[torch.Tensor],
                  visible: list[torch.Tensor], scaling: float) -> torch.Tensor:
    """One decode step of attention where each KV head sees only its visible entries.

    q: [batch, q_heads, head_dim]; k_cache / v_cache: [slots, kv_heads, head_dim]; rows: per request, int
    slot ids [kv_len_b]; visible: per request, bool [kv_heads, kv_len_b]. Returns [batch, q_heads, head_dim].
    A head with nothing visible would be undefined; the window keeps the newest tokens, so it never happens.
    """
    out = torch.empty_like(q)
    q_heads, kv_heads = q.shape[1], k_cache.shape[1]
    group = q_heads // kv_heads
    for b, (row, vis) in enumerate(zip(rows, visible)):
        slots = row.to(torch.int64)
        key = k_cache[slots].transpose(0, 1).to(q.dtype)  # [kv_heads, kv_len, d]
        value = v_cache[slots].transpose(0, 1).to(q.dtype)
        mask = vis.to(q.device).repeat_interleave(group, dim=0)[:, None, :]  # [q_heads, 1, kv_len]
        out[b] = torch.nn.functional.scaled_dot_product_attention(
            q[b][:, None, :], key, value, attn_mask=mask, scale=scaling, enable_gqa=True)[:, 0, :]
    return out


def native_backend_class(runtime):
    """``TorchNativeAttnBackend`` whose decode masks each head's evicted entries (``runtime``: a callable
    returning this process's ``KVzapSGLang``)."""
    base = sglang_module("sglang.srt.layers.attention.torch_native_backend").TorchNativeAttnBackend

    class KVzapNativeAttnBackend(base):
        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            if layer.is_cross_attention or layer.qk_head_dim != layer.v_head_dim:
                return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
            if save_kv_cache and k is not None and v is not None:
                self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
            rt = runtime()
            req_to_token = self.req_to_token_pool.req_to_token
            rows, visible = [], []
            for idx, kv_len in zip(forward_batch.req_pool_indices.tolist(), forward_batch.seq_lens.tolist()):
                rows.append(req_to_token[idx, : int(kv_len)])
                visible.append(rt.visible(idx, layer.layer_id, int(kv_len)))
            q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
            out = masked_decode(q3, self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                                self.token_to_kv_pool.get_value_buffer(layer.layer_id), rows, visible, layer.scaling)
            return out.reshape(q3.shape[0], -1)

    return KVzapNativeAttnBackend


def flex_backend_class(runtime):
    """``TorchFlexAttnBackend`` whose decode masks each head's evicted entries (GPU; ``runtime`` as above)."""
    base = sglang_module("sglang.srt.layers.attention.torch_flex_backend").TorchFlexAttnBackend

    class KVzapFlexAttnBackend(base):
        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            self.decode_block_masks = decode_block_masks(runtime(), layer, forward_batch, self.device)
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)

    return KVzapFlexAttnBackend


def decode_block_masks(rt, layer, forward_batch, device) -> list:
    """One flex-attention block mask per request of the batch, for one layer."""
    from torch.nn.attention.flex_attention import create_block_mask

    group = layer.tp_q_head_num // layer.tp_k_head_num
    masks = []
    for idx, kv_len in zip(forward_batch.req_pool_indices.tolist(), forward_batch.seq_lens.tolist()):
        visible = rt.visible(idx, layer.layer_id, int(kv_len)).to(device)
        masks.append(create_block_mask(visibility_mask_mod(visible, group), None, layer.tp_q_head_num, 1, int(kv_len),
                                       device=device, _compile=False))
    return masks


def register(runtime) -> None:
    """Registers both masking backends and adds their names to ``--attention-backend``'s choices."""
    registry = sglang_module("sglang.srt.layers.attention.attention_registry")
    choices = sglang_module("sglang.srt.arg_groups.choices")
    native, flex = native_backend_class(runtime), flex_backend_class(runtime)
    registry.register_attention_backend(NATIVE_BACKEND)(lambda runner: native(runner))
    registry.register_attention_backend(FLEX_BACKEND)(lambda runner: flex(runner))
    choices.add_attention_backend_choices(list(BACKENDS))
