"""K/V moves in TensorRT-LLM's paged cache (engine-free): each head's kept entries to the front of the request's
pages, the pages a request's layer holds, and how far its cache may shrink."""

from __future__ import annotations

import torch

from kvzap_export.errors import ConfigError


def move_paged_kv(pool: torch.Tensor, pages: torch.Tensor, indices: torch.Tensor) -> None:
    """Moves one layer's kept K/V of one request to the front of its pages, per head, in place.

    pool: [num_pages, kv_factor, kv_heads, tokens_per_block, head_dim] (TensorRT-LLM's HND pool view);
    pages: int [n] the request's page ids in order; indices: int [kv_heads, K] physical source tokens
    (``Decision.indices[layer]``). Afterwards token ``j`` of head ``h`` holds old token ``indices[h, j]``.
    """
    tpb = pool.shape[3]
    pages = pages.to(device=pool.device, dtype=torch.int64)
    src = indices.to(device=pool.device, dtype=torch.int64)
    H, K = src.shape
    heads = torch.arange(H, device=pool.device)[:, None]
    dst = torch.arange(K, device=pool.device)[None, :].expand(H, K)
    values = pool[pages[src // tpb], :, heads, src % tpb, :]  # [H, K, kv_factor, head_dim]: a copy
    pool[pages[dst // tpb], :, heads, dst % tpb, :] = values


def reserved_tail(manager) -> int:
    """Tokens a resize must keep past the kept entries: the manager's extra KV tokens (``num_extra_kv_tokens``
    of ``KVCacheManagerV2`` at af8c3bfa; 0 when absent). The overlap scheduler, which would also reserve the
    next step's slots, is refused (``KVzapCompressionManager``)."""
    return int(getattr(manager, "num_extra_kv_tokens", 0) or 0)


def cache_pages(manager, request_id: int, layer: int, tokens: int, tokens_per_block: int) -> torch.Tensor:
    """The request's page ids for one (global) layer, one per block of its capacity, in order.

    ``get_batch_cache_indices`` marks a block whose page was dropped (sliding-window layers) with -1, in place:
    the position of every later page depends on it. A -1 among the blocks holding the first ``tokens`` tokens
    is refused: KVzap moves entries across the whole sequence, which needs every page of full attention.
    """
    pages = torch.tensor([int(p) for p in manager.get_batch_cache_indices([request_id], layer)[0]], dtype=torch.int64)
    needed = -(-tokens // tokens_per_block)
    if needed > pages.numel() or bool((pages[:needed] < 0).any()):
        raise ConfigError(f"layer {layer} of request {request_id} has dropped or missing pages among its first {tokens} "
                          "tokens (a sliding-window layer?); KVzap supports full-attention layers only")
    return pages


def compaction_capacity(count: int, tail: int, history_length: int) -> int:
    """The capacity a request's cache can shrink to after keeping ``count`` entries.

    ``KVCacheManagerV2`` never lowers a cache's history length (the prompt, once its last chunk ran; generation
    steps pass no history while a compression manager owns it), and a capacity below it is an error. So the
    pages of evicted *prompt* entries stay allocated until the request ends; what eviction saves there is
    attention work and reads. Decoding past the prompt is where pages are given back.
    """
    return max(count + tail, history_length)


def check_pool(pool: torch.Tensor, kv_heads: int, layer: int) -> None:
    """A pool KVzap can move entries of: K/V in elements of their own (no packed NVFP4 bytes, whose block scales
    live elsewhere) and this rank's KV heads (``install(mapping=...)`` slices the surrogate the same way)."""
    if pool.dtype in (torch.int8, torch.uint8):
        raise ConfigError(f"layer {layer}: the KV cache is packed ({pool.dtype}, e.g. NVFP4) and its block scales would "
                          "stay behind; use an FP16/BF16/FP8 KV cache with KVzap")
    if pool.shape[2] != kv_heads:
        raise ConfigError(f"layer {layer}: the KV pool holds {pool.shape[2]} heads, KVzap's surrogate slice {kv_heads}; "
                          "pass this rank's mapping to install()")
