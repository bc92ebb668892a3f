"""Attention over per-head KV rows (the ragged layout of docs/ragged-kv.md), one call per layer for a batch.

K and V live in one pool of one-head entries, ``k_store`` [E, D] and ``v_store`` [E, Dv]; each KV head of each
request has its own row of entry ids. Query head ``q`` reads KV head ``q // group`` (grouped-query attention
stays exact). Lengths come from the host (the caller knows them before the forward): nothing here reads the
device back.

- ``decode_attention``: one query token per request, the whole batch at once, over the batch's entry ids in one
  padded layout [B, H, W] (W: the longest row of this layer): one gather of the keys, one batched matrix product
  for the scores, a softmax masked by each row's length, and one ``embedding_bag`` that sums the value rows
  in place, weighted by the probabilities (values are never copied out of the pool; on this path the pool's
  memory traffic is what costs). Where KVzap left the heads of a layer very unequal, padding every row to the
  longest one reads entries nobody attends to (4,096-token prompts: 1.38x the entries held); ``row_groups`` then
  splits the rows, sorted by length, into a few groups padded each to its own longest row, one call per group,
  chosen by a cost model from the host lengths (one call costs about as much as gathering ``CALL_ENTRIES``
  entries on this path). Torch ops on every device: the engine's decode on CUDA runs SGLang's kernel over buffers
  laid out before the forward instead (``flattened_step``); this path serves the CPU, the masking modes (a
  ``visible`` mask) and ragged mode's ``KVZAP_RAGGED_DECODE_KERNEL=torch``.
- ``causal_extend_attention``: the prompts of an extend batch when nothing is cached before them (a fresh
  prompt is dense: KVzap decides after the prefill forward): causal attention over the new K/V themselves, no
  gather, one call (``is_causal`` when the prompts have one length, else a padding mask).
- ``prefix_extend_attention``: an extend batch whose requests already hold entries (a prompt chunk after the
  first): each head's held prefix entries, gathered, then the new tokens causally; one call per block of queries
  (the scores of a block stay under ``BLOCK_SCORE_BYTES``).

A head with no entry gives zeros. ``ragged_decode_attention`` is the plain float32 formula of the decode
case, written independently of the fast path (the reference every decode kernel is tested against).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvzap_export.errors import InputError
from kvzap_export.kernels.ragged_shapes import query_group


def ragged_decode_attention(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, ids: torch.Tensor,
                            lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """The formula, in float32: q [B, q_heads, D]; ids int [B, kv_heads, n] (entries past ``lengths[b, h]`` are
    ignored); lengths int [B, kv_heads]. Returns [B, q_heads, Dv] in q's dtype."""
    group = query_group(q, k_store, v_store, ids)
    B, Hq, D = q.shape
    H, n = ids.shape[1], ids.shape[2]
    safe = ids.clamp(min=0).to(torch.int64)
    keys, values = k_store[safe].float(), v_store[safe].float()  # [B, H, n, D]
    mask = torch.arange(n, device=ids.device) < lengths.to(ids.device)[..., None]  # [B, H, n]
    scores = q.float().view(B, H, group, D) @ keys.transpose(-1, -2) * scale  # [B, H, group, n]
    scores = scores.masked_fill(~mask[:, :, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an all-masked row: softmax is NaN -> 0
    return (weights @ values).reshape(B, Hq, -1).to(q.dtype)


CALL_ENTRIES = 2048  # one padded call's fixed cost on the CPU, in entries gathered (measured: ~170 us, ~80 ns/entry)
MAX_GROUPS = 4


def row_groups(lengths: list[int], most: int = MAX_GROUPS,
               call_cost: int | None = None) -> list[tuple[list[int], int]] | None:
    """How to split one layer's rows (``lengths``: each (request, KV head) row's entries, host ints, in row order)
    into groups padded each to its own longest row: [(row indices, width), ...] (every row in exactly one group),
    or None where one padded call costs least. Rows sorted by length are cut into 2 to ``most`` runs of equal
    count; a split costs its padded entries plus ``call_cost`` (default ``CALL_ENTRIES``) entries per call."""
    call_cost = CALL_ENTRIES if call_cost is None else call_cost
    n = len(lengths)
    if n < 2:
        return None
    order = sorted(range(n), key=lengths.__getitem__)
    ranked = [lengths[i] for i in order]
    best, best_cost = 1, n * ranked[-1] + call_cost
    for k in range(2, min(most, n) + 1):
        cuts = [n * i // k for i in range(k + 1)]
        cost = sum((cuts[i + 1] - cuts[i]) * ranked[cuts[i + 1] - 1] for i in range(k)) + k * call_cost
        if cost < best_cost:
            best, best_cost = k, cost
    if best == 1:
        return None
    cuts = [n * i // best for i in range(best + 1)]
    return [(order[cuts[i]:cuts[i + 1]], ranked[cuts[i + 1] - 1]) for i in range(best)]


def layer_groups(per_layer: list[list[int]], device=None, most: int = MAX_GROUPS,
                 call_cost: int | None = None) -> list[list[tuple[torch.Tensor, int]] | None]:
    """``row_groups`` for each layer's row lengths, the rows as int64 tensors on ``device`` (``decode_attention``'s
    ``groups``)."""
    out = []
    for lengths in per_layer:
        split = row_groups(lengths, most, call_cost)
        out.append(None if split is None else [(torch.tensor(r, dtype=torch.int64, device=device), w) for r, w in split])
    return out


def decode_attention(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, ids: torch.Tensor,
                     lengths: torch.Tensor, scale: float, workspace: torch.Tensor | None = None,
                     visible: torch.Tensor | None = None,
                     groups: list[tuple[torch.Tensor, int]] | None = None) -> torch.Tensor:
    """q [B, q_heads, D]; k_store [E, D], v_store [E, Dv] (contiguous); ids int32/int64 [B, kv_heads, W] (padding:
    any valid id); lengths int [B, kv_heads]. Returns [B, q_heads, Dv] in q's dtype. ``workspace``: a flat tensor of
    the stores' dtype the key gather may reuse (at least B * kv_heads * W * D elements; a fresh allocation of
    that size costs page faults at every layer). ``visible``: bool [B, kv_heads, W], entries attention may see
    besides the length (the masking modes: SGLang's slots hold entries kvpress evicted).
    ``groups``: ``layer_groups``' split: groups of rows (b * kv_heads + h, an int64 tensor on q's device) that
    partition all B * kv_heads rows, each with a width at least its rows' lengths."""
    group = query_group(q, k_store, v_store, ids)
    B, Hq, D = q.shape
    H, W = ids.shape[1], ids.shape[2]
    if W == 0:
        return q.new_zeros(B, Hq, v_store.shape[-1])
    q_rows, id_rows, len_rows = q.reshape(B * H, group, D), ids.reshape(B * H, W), lengths.reshape(B * H)
    seen = None if visible is None else visible.reshape(B * H, W)
    if groups is None:
        return _padded_decode(q_rows, k_store, v_store, id_rows, len_rows, scale, workspace, seen).view(B, Hq, -1)
    out = q.new_empty(B * H, group, v_store.shape[-1])
    for rows, width in groups:
        out.index_copy_(0, rows, _padded_decode(q_rows[rows], k_store, v_store, id_rows[rows, :width], len_rows[rows],
                                                scale, workspace, None if seen is None else seen[rows, :width]))
    return out.view(B, Hq, -1)


def _padded_decode(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, ids: torch.Tensor,
                   lengths: torch.Tensor, scale: float, workspace: torch.Tensor | None,
                   visible: torch.Tensor | None) -> torch.Tensor:
    """The torch path over rows padded to one width: q [rows, group, D], ids [rows, W], lengths [rows], visible
    [rows, W] or None. Returns [rows, group, Dv] in q's dtype."""
    rows, group, D = q.shape
    W = ids.shape[1]
    if W == 0:
        return q.new_zeros(rows, group, v_store.shape[-1])
    flat = ids.reshape(-1)
    if workspace is not None and workspace.numel() >= flat.shape[0] * D:
        keys = torch.index_select(k_store, 0, flat, out=workspace[: flat.shape[0] * D].view(-1, D))
    else:
        keys = k_store.index_select(0, flat)
    # Scores and softmax in float32 (as the formula): in bf16 a score near 20 is rounded by 0.125
    scores = torch.bmm(q.float(), keys.view(rows, W, D).float().transpose(1, 2))  # [rows, G, W]
    held = torch.arange(W, device=q.device) < lengths.reshape(rows, 1)  # [rows, W] (lengths on q's device)
    if visible is not None:
        held = held & visible
    scores.mul_(scale).masked_fill_(~held[:, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    bags = flat.view(rows, 1, W).expand(rows, group, W).reshape(-1)  # one bag of W entries per query head
    offsets = torch.arange(0, bags.shape[0], W, device=q.device, dtype=bags.dtype)
    out = F.embedding_bag(bags, v_store, offsets, mode="sum", per_sample_weights=weights.reshape(-1).to(v_store.dtype))
    nonempty = held.any(-1, keepdim=True) if visible is not None else held[:, :1]
    out = torch.where(nonempty.repeat_interleave(group, 0), out, 0.0)  # a head that holds nothing: zeros
    return out.view(rows, group, -1).to(q.dtype)


def token_positions(lens: list[int], device=None) -> torch.Tensor | None:
    """int64 [T]: where each of the requests' tokens (``lens`` each, one request after the other) sits in a
    right-padded [B, max(lens)] layout; None when every request has the same length (no padding). Built once per
    step from the host lengths, so padding needs no boolean indexing (a device read on a GPU)."""
    n = max(lens)
    if all(length == n for length in lens):
        return None
    starts = torch.arange(len(lens)) * n
    return torch.cat([torch.arange(length) + start for length, start in zip(lens, starts.tolist())]).to(device)


def _padded(x: torch.Tensor, lens: list[int], where: torch.Tensor | None) -> torch.Tensor:
    """[T, heads, d] with requests of ``lens`` tokens one after the other -> [B, heads, n, d] (n = max lens)."""
    B, n = len(lens), max(lens)
    if where is None:
        return x.view(B, n, x.shape[1], x.shape[2]).transpose(1, 2)
    out = x.new_zeros(B * n, x.shape[1], x.shape[2]).index_copy_(0, where, x)
    return out.view(B, n, x.shape[1], x.shape[2]).transpose(1, 2)


def _unpadded(out: torch.Tensor, where: torch.Tensor | None) -> torch.Tensor:
    """[B, heads, n, d] -> [T, heads, d]."""
    out = out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3])
    return out if where is None else out.index_select(0, where)


def causal_extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float,
                            where: torch.Tensor | None = None) -> torch.Tensor:
    """Fresh prompts, attended over their own K/V. q [T, q_heads, D], k [T, kv_heads, D], v [T, kv_heads, Dv],
    requests one after the other, ``lens`` tokens each (host); ``where``: ``token_positions(lens)`` (computed here
    when not given). Returns [T, q_heads, Dv].

    Prompts of unequal length are right-padded: a real query's causal keys are all real, and what padded
    queries compute is discarded, so ``is_causal`` is exact for every prompt."""
    if not lens or sum(lens) != q.shape[0]:
        raise InputError(f"causal_extend_attention: {q.shape[0]} tokens, prompts of {lens}")
    where = where if where is not None else token_positions(lens, q.device)
    out = F.scaled_dot_product_attention(_padded(q, lens, where), _padded(k, lens, where), _padded(v, lens, where),
                                         is_causal=True, scale=scale, enable_gqa=True)
    return _unpadded(out, where)


# A prefix chunk's attention in one call would hold scores of [B, q_heads, n, P + n] (n: the chunk, P: the held
# prefix): SDPA's math kernel materializes them in float32, and it is the kernel a boolean mask with grouped KV heads
# gets on CUDA (flash takes no mask, the memory-efficient kernel no grouped heads). A 32k prompt on Llama-3.1-8B
# chunked by 8,192 would need ~32 GiB per layer call, so queries go in blocks whose scores stay under this many bytes
# (a block attends to the keys up to its last query only).
BLOCK_SCORE_BYTES = 256 << 20


def query_block(batch: int, q_heads: int, keys: int, queries: int, budget: int = BLOCK_SCORE_BYTES) -> int:
    """Queries per block: the most whose float32 scores over ``keys`` keys (every head, every request) fit ``budget``;
    at least one."""
    return max(1, min(queries, budget // max(1, 4 * batch * q_heads * keys)))


def prefix_extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int],
                            prefix_k: torch.Tensor, prefix_v: torch.Tensor, prefix_lengths: torch.Tensor, scale: float,
                            heads_agree: bool = False, where: torch.Tensor | None = None,
                            block_bytes: int = BLOCK_SCORE_BYTES) -> torch.Tensor:
    """Prompt chunks after entries already held. q, k, v and ``lens`` as ``causal_extend_attention``; prefix_k
    [B, kv_heads, P, D] and prefix_v [B, kv_heads, P, Dv] each head's held entries gathered (padded),
    ``prefix_lengths`` int [B, kv_heads];
    ``heads_agree``: every head of a request holds as many entries (a prefix nothing pruned yet: one mask
    serves every head). Every held entry precedes the chunk (an earlier forward appended it), so each query
    sees all of its head's held entries, then the chunk's tokens up to itself. Returns [T, q_heads, Dv].

    Queries run in blocks of ``query_block`` (scores under ``block_bytes``). The query heads of a KV head are folded
    into the query axis ([B, kv_heads, group * m, D] against that head's keys): SDPA sees as many query as KV heads,
    so on CUDA its memory-efficient kernel takes the mask, and no K/V is copied per query head."""
    if not lens or sum(lens) != q.shape[0]:
        raise InputError(f"prefix_extend_attention: {q.shape[0]} tokens, chunks of {lens}")
    B, H, P, _ = prefix_k.shape
    n, group, dv = max(lens), q.shape[1] // H, v.shape[-1]
    where = where if where is not None else token_positions(lens, q.device)
    qp, kp, vp = _padded(q, lens, where), _padded(k, lens, where), _padded(v, lens, where)
    keys = torch.cat([prefix_k, kp], dim=2)  # [B, H, P + n, D]
    values = torch.cat([prefix_v, vp], dim=2)
    lengths = prefix_lengths[:, :1] if heads_agree else prefix_lengths
    held = torch.arange(P, device=q.device) < lengths[..., None]  # [B, H or 1, P]
    heads = held.shape[1]
    block = query_block(B, q.shape[1], P + n, n, block_bytes)
    outs = []
    for start in range(0, n, block):
        stop = min(start + block, n)
        m = stop - start
        causal = torch.ones(m, stop, dtype=torch.bool, device=q.device).tril(start)  # query start + i: keys <= it
        mask = torch.cat([held[:, :, None, :].expand(-1, -1, m, P), causal.expand(B, heads, m, stop)], dim=-1)
        mask = mask[:, :, None].expand(-1, -1, group, -1, -1).reshape(B, heads, group * m, P + stop)
        queries = qp[:, :, start:stop].reshape(B, H, group * m, -1)  # query head h * group + g reads KV head h
        out = F.scaled_dot_product_attention(queries, keys[:, :, : P + stop], values[:, :, : P + stop], attn_mask=mask,
                                             scale=scale)
        outs.append(out.view(B, H * group, m, dv))
    return _unpadded(outs[0] if len(outs) == 1 else torch.cat(outs, dim=2), where)
