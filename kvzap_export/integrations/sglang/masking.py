"""Mask and evict modes' attention backends: decode attends, per KV head, only to the entries kvpress keeps.

Mask mode frees nothing (SGLang's slots hold every token); evict mode holds one length per request, so the
other heads' extras are masked. The decisions are exact kvpress semantics: the prefill forward is dense,
decisions apply to later forwards. Two backends, registered with SGLang's ``register_attention_backend`` when
``KVZAP_MODE`` is ``mask`` or ``evict``:

- ``kvzap_native`` (CPU and GPU): SGLang's ``torch_native`` backend whose decode attends over the whole batch
  in one call per layer (``kernels.ragged_attention.decode_attention`` over SGLang's own K/V buffers, each
  (request, KV head) reading the request's slots) with each KV head's visible set as a mask (each query head
  uses its KV head's row: GQA stays exact). The batch's slots and masks are laid out once per step before the
  forward, from the host (an aux cache on SGLang's request pool records the step's rows). Extends stay
  SGLang's own dense attention, as in kvpress.
- ``kvzap_flex`` (GPU): SGLang's ``flex_attention`` backend with a per-layer, per-head ``mask_mod`` (one block
  mask per request and layer, as SGLang's flex backend takes them). It runs eagerly on the CPU engine in CI
  (tests/integrations/sglang/test_engine.py); its masks are checked against per-head masked attention in
  tests/integrations/sglang/test_runtime.py.
"""

from __future__ import annotations

import torch

from kvzap_export.integrations.host_reads import counted
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


class HostRows:
    """SGLang's aux-cache protocol for ``ReqToTokenPool``, used only to learn each step's request rows on the host
    before its forward (``alloc_to_lengths``); it stores nothing."""

    def __init__(self, dense_capacity: int):
        self.dense_capacity = dense_capacity
        self.rows: list[int] | None = None

    @counted("forward")
    def alloc_to_lengths(self, *, req_pool_indices_cpu, target_seq_lens_cpu) -> None:
        self.rows = [int(r) for r in req_pool_indices_cpu.tolist()]

    def take_rows(self, batch_size: int) -> list[int] | None:
        rows, self.rows = self.rows, None
        return rows if rows is not None and len(rows) == batch_size else None

    def free(self, row) -> None:
        pass

    def clear(self) -> None:
        self.rows = None

    def reset_allocator(self) -> None:
        pass


def native_backend_class(runtime):
    """``TorchNativeAttnBackend`` whose decode masks each head's evicted entries, the whole batch per call
    (``runtime``: a callable returning this process's ``KVzapSGLang``)."""
    base = sglang_module("sglang.srt.layers.attention.torch_native_backend").TorchNativeAttnBackend

    class KVzapNativeAttnBackend(base):
        def __init__(self, model_runner):
            super().__init__(model_runner)
            requests = model_runner.req_to_token_pool
            if requests._aux_cache is None:
                requests.attach_aux_cache(HostRows(int(model_runner.token_to_kv_pool_allocator.size)))
            self.host_rows = requests._aux_cache
            self.view = None
            self.workspace = torch.empty(0)
            pool = self.token_to_kv_pool
            if pool.get_key_buffer(0).dim() != 3 or int(pool.size + pool.page_size) * int(pool.head_num) >= 2**31:
                # the decode reads [slots, kv_heads, D] buffers as one-head entries slot * kv_heads + head (int32)
                raise SystemExit("kvzap-export: KVzap's masking backend reads SGLang's K/V as [slots, kv_heads, "
                                 "head_dim] (unset SGLANG_USE_HND_KVCACHE, or use --page-size 1)")

        @counted("forward")
        def init_forward_metadata(self, forward_batch):
            super().init_forward_metadata(forward_batch)
            self.view = None
            if not forward_batch.forward_mode.is_decode():
                return
            rows = self.host_rows.take_rows(int(forward_batch.batch_size))
            if rows is None:  # not recorded by the aux cache: read the rows (one read of the device per forward)
                rows = [int(r) for r in forward_batch.req_pool_indices.tolist()]
            lengths = [int(n) for n in forward_batch.seq_lens_cpu.tolist()]
            self.view = decode_view(runtime(), self.req_to_token_pool.req_to_token, rows, lengths,
                                    self.token_to_kv_pool.head_num, self.device)
            need = len(rows) * self.view[0].shape[1] * self.view[0].shape[2] * self.token_to_kv_pool.head_dim
            if need > self.workspace.numel():
                self.workspace = torch.empty(int(need * 1.25), dtype=self.token_to_kv_pool.store_dtype, device=self.device)

        @counted("forward")
        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            from kvzap_export.kernels.ragged_attention import decode_attention

            if layer.is_cross_attention or self.use_sliding_window_kv_pool or (
                    layer.sliding_window_size is not None and layer.sliding_window_size > -1):
                raise SystemExit("kvzap-export: KVzap's masking backend serves plain causal self-attention (no "
                                 f"cross-attention, no sliding window); layer {layer.layer_id} is not one")
            if save_kv_cache and k is not None and v is not None:
                self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
            ids, lengths, visible = self.view
            k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
            v_buffer = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
            q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
            out = decode_attention(q3, k_buffer.view(-1, k_buffer.shape[-1]), v_buffer.view(-1, v_buffer.shape[-1]),
                                   ids, lengths, layer.scaling, self.workspace, visible[:, layer.layer_id])
            return out.reshape(q3.shape[0], -1)

    return KVzapNativeAttnBackend


def decode_view(rt, req_to_token: torch.Tensor, rows: list[int], lengths: list[int], kv_heads: int, device):
    """One decode step's batch over SGLang's slot-major K/V buffers ``[slots, kv_heads, D]`` seen as one-head
    entries ``slot * kv_heads + head``: (ids int32 [B, H, W], lengths int [B, H], visible bool [B, L, H, W]), W the
    longest request. Laid out once per step from host lengths; the masks come from each request's state."""
    width = max(lengths)
    rows_t = torch.tensor(rows, dtype=torch.int64, device=device)
    slots = req_to_token[rows_t, :width].to(torch.int32)  # [B, W]
    heads = torch.arange(kv_heads, dtype=torch.int32, device=device)
    ids = slots[:, None, :] * kv_heads + heads[None, :, None]
    length = torch.tensor(lengths, device=device)[:, None].expand(len(rows), kv_heads)
    return ids, length, rt.batch_visibility(rows, width, device)


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
