"""A pure-torch model of one Llama-3.1-8B decoder layer's decode step, dense vs ragged (docs/ragged-kv.md), as
``scripts/bench_ragged_decode.py`` times it. Runs on any device (the benchmark: CUDA, in CUDA graphs; its tests:
CPU tensors in float32); only torch is imported.

- layouts: each KV head's kept length (``kept_lengths``) and its entries shuffled in one pool (``pool_layout``);
- the layer (``Layer``: RMSNorm, QKV, attention, O, RMSNorm, SwiGLU FFN; random weights; no rotary embedding, which
  both modes would pay alike) and the KVzap MLP surrogate (hidden -> 512 -> kv_heads, GELU) that scores each token;
- dense (``dense_step``): K/V written at the end of a full [B, kv_heads, T, D] cache, SDPA over every entry;
- ragged (``ragged_step`` on a ``RaggedState``): K/V in one-head stores ([E, D] K and V, scores [E]) addressed by
  int32 entry ids per head; the token's K/V and its surrogate score written at preallocated entry ids, the token
  appended to its rows, attention through the given ``attend(q, k, v, ids, lengths, scale)`` callable (the torch
  formula of ``kernels.ragged_attention``, SGLang's kernel through ``kernels.flattened_attention.FlattenedDecode``),
  then the decision for the entry leaving the ``WINDOW``-token window: tested against tau and removed from its row
  if evicted, evicted ids pushed on the free stack and the next step's ids popped. All on the device, no read-back:
  a step can be captured in a CUDA graph.

Defaults are Llama-3.1-8B's shapes in bf16 on CUDA (the module constants below); every one is a parameter.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

Q_HEADS, KV_HEADS, HEAD_DIM, HIDDEN, FFN, SURROGATE_HIDDEN, WINDOW = 32, 8, 128, 4096, 14336, 512, 128
HEADROOM = 64  # steps of room in every row and the pool (warm-ups, repetitions, replays)
DEVICE, DTYPE = "cuda", torch.bfloat16


# ---- layouts (pure torch: run on any device) ------------------------------------------------------------------
def kept_lengths(batch: int, kv_heads: int, seq: int, pruned: float, generator: torch.Generator) -> torch.Tensor:
    """int32 [B, H]: each head's kept entries, uniform within +-25% of (1 - pruned) * seq, in [1, seq]."""
    mean = (1 - pruned) * seq
    draw = torch.rand(batch, kv_heads, generator=generator, device=generator.device)
    return (mean * (0.75 + 0.5 * draw)).round().clamp(1, seq).to(torch.int32)


def pool_layout(lengths: torch.Tensor, width: int, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """Each head's entries: its slice of one random permutation of [0, total) (entries shuffled in one pool).
    Returns (ids int32 [B, H, width], padding 0; total)."""
    flat = lengths.reshape(-1).to(torch.int64)
    total = int(flat.sum())
    perm = torch.randperm(max(total, 1), generator=generator, device=lengths.device).to(torch.int32)
    start = torch.cumsum(flat, 0) - flat
    column = torch.arange(width, device=lengths.device)
    where = (start[:, None] + column).clamp(max=max(total - 1, 0))
    ids = torch.where(column < flat[:, None], perm[where], 0)
    return ids.view(*lengths.shape, width).to(torch.int32), total


# ---- one decoder layer -----------------------------------------------------------------------------------------
class Layer:
    """Random weights of a Llama decoder layer and of the KVzap MLP surrogate (hidden -> 512 -> kv_heads, GELU)."""

    def __init__(self, hidden=None, q_heads=None, kv_heads=None, head_dim=None, ffn=None, surrogate_hidden=None,
                 dtype=None, device=None, seed=0):
        hidden, q_heads, kv_heads = hidden or HIDDEN, q_heads or Q_HEADS, kv_heads or KV_HEADS
        head_dim, ffn, surrogate_hidden = head_dim or HEAD_DIM, ffn or FFN, surrogate_hidden or SURROGATE_HIDDEN
        dtype, device = dtype or DTYPE, device or DEVICE
        g = torch.Generator(device=device).manual_seed(seed)
        w = lambda *shape: (torch.randn(*shape, generator=g, device=device) * 0.02).to(dtype)  # noqa: E731
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, head_dim
        self.w_qkv, self.w_o = w((q_heads + 2 * kv_heads) * head_dim, hidden), w(hidden, q_heads * head_dim)
        self.w_gate_up, self.w_down = w(2 * ffn, hidden), w(hidden, ffn)
        self.norm1, self.norm2 = (torch.ones(hidden, device=device, dtype=dtype) for _ in range(2))
        self.s1, self.b1 = w(surrogate_hidden, hidden), w(surrogate_hidden)
        self.s2, self.b2 = w(kv_heads, surrogate_hidden), w(kv_heads)
        self.scale = 1 / math.sqrt(head_dim)

    def front(self, x):
        """x [B, hidden] -> (h: the attention input, q [B, q_heads, D], k, v [B, kv_heads, D])."""
        h = F.rms_norm(x, (x.shape[-1],), self.norm1, 1e-5)
        qkv = h @ self.w_qkv.T
        nq, nk = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        q = qkv[:, :nq].view(-1, self.q_heads, self.head_dim)
        k = qkv[:, nq: nq + nk].view(-1, self.kv_heads, self.head_dim)
        return h, q, k, qkv[:, nq + nk:].view(-1, self.kv_heads, self.head_dim)

    def back(self, x, attn):
        """x [B, hidden], attn [B, q_heads * D] -> the layer's output [B, hidden]."""
        x = x + attn @ self.w_o.T
        gate, up = (F.rms_norm(x, (x.shape[-1],), self.norm2, 1e-5) @ self.w_gate_up.T).chunk(2, -1)
        return x + (F.silu(gate) * up) @ self.w_down.T

    def scores(self, h):
        """The surrogate's log-importance per KV head [B, kv_heads] (kvpress: weights in the activation dtype)."""
        return F.gelu(h @ self.s1.T + self.b1) @ self.s2.T + self.b2


def dense_step(layer: Layer, k_cache, v_cache, x):
    """K/V written at the last position of full caches [B, H, T, D]; SDPA with each group's query heads as query
    positions (no mask: a decode query sees every entry)."""
    _, q, k, v = layer.front(x)
    B, H = k.shape[0], k.shape[1]
    k_cache[:, :, -1] = k
    v_cache[:, :, -1] = v
    attn = F.scaled_dot_product_attention(q.reshape(B, H, -1, q.shape[-1]), k_cache, v_cache, scale=layer.scale)
    return layer.back(x, attn.reshape(B, -1))


class RaggedState:
    """One layer's ragged K/V for a batch: stores [E, D] and scores [E], ids int32 [B, H, W], lengths int32 [B, H],
    a free stack (``free`` [E + 1], the last a spare slot; ``top`` int64 [1] on the device), the next token's entry
    ids ``fresh`` [B, H] (taken from the stack). Everything on the device; steps never read it back."""

    def __init__(self, lengths, ids, total, head_dim, dtype, generator, spare_steps=HEADROOM):
        device = lengths.device
        B, H, W = ids.shape
        E = total + B * H * (spare_steps + 2)
        self.k = torch.randn(E, head_dim, generator=generator, device=device, dtype=dtype)
        self.v = torch.randn(E, head_dim, generator=generator, device=device, dtype=dtype)
        self.scores = torch.randn(E, generator=generator, device=device, dtype=dtype)
        self.ids = torch.cat([ids, ids.new_zeros(B, H, spare_steps + 2)], -1)  # room to append
        self.lengths = lengths.clone().to(torch.int32)
        self.free = torch.cat([torch.arange(E - 1, total - 1, -1, device=device), torch.zeros(total + 1, device=device,
                                                                                                dtype=torch.int64)])
        self.free = self.free.to(torch.int32)
        self.top = torch.full((1,), E - total, dtype=torch.int64, device=device)
        self.fresh = torch.zeros(B, H, dtype=torch.int32, device=device)
        self._pop()

    def _pop(self):
        BH = self.fresh.numel()
        self.fresh.view(-1).copy_(self.free[self.top - BH + torch.arange(BH, device=self.top.device)])
        self.top.sub_(BH)

    def clone(self):
        other = object.__new__(RaggedState)
        other.__dict__ = {name: t.clone() for name, t in self.__dict__.items()}
        return other

    def copy_(self, other):
        for name, t in self.__dict__.items():
            t.copy_(getattr(other, name))


def ragged_write(st: RaggedState, k, v) -> None:
    """The token's K/V written at its preallocated entries, its row entries appended (lengths + 1)."""
    B, H, D = k.shape
    fresh = st.fresh.view(-1).to(torch.int64)
    st.k.index_copy_(0, fresh, k.reshape(B * H, D))
    st.v.index_copy_(0, fresh, v.reshape(B * H, D))
    st.ids.scatter_(2, st.lengths.to(torch.int64)[..., None], st.fresh[..., None])  # append the token
    st.lengths.add_(1)


def ragged_score(layer: Layer, st: RaggedState, h) -> None:
    """The surrogate's scores of the token, written at its entries (the scoring hook's work)."""
    fresh = st.fresh.view(-1).to(torch.int64)
    st.scores.index_copy_(0, fresh, layer.scores(h).reshape(-1).to(st.scores.dtype))


def ragged_decide(st: RaggedState, tau: float) -> None:
    """The entry that left the window (row index length - window - 1; undecided entries are all held) tested against
    tau and removed from its row if evicted; evicted ids pushed on the free stack, the next step's ids popped."""
    start = st.lengths.to(torch.int64) - WINDOW - 1
    columns = start.clamp(min=0)[..., None] + torch.arange(WINDOW + 1, device=st.ids.device)
    tail = st.ids.gather(2, columns)
    candidate = tail[..., 0]
    evict = (st.scores[candidate.to(torch.int64)] < tau) & (start >= 0)
    shifted = torch.cat([tail[..., 1:], tail[..., -1:]], -1)
    st.ids.scatter_(2, columns, torch.where(evict[..., None], shifted, tail))
    st.lengths.sub_(evict.to(torch.int32))
    gone = evict.view(-1)
    where = torch.where(gone, st.top + torch.cumsum(gone, 0) - 1, st.free.shape[0] - 1)
    st.free.index_put_((where,), candidate.view(-1))
    st.top.add_(gone.sum())
    st._pop()


def ragged_step(layer: Layer, st: RaggedState, x, attend, tau: float):
    """One decode step of the ragged mode (see the module docstring); ``attend(q, k, v, ids, lengths, scale)``."""
    h, q, k, v = layer.front(x)
    ragged_write(st, k, v)
    ragged_score(layer, st, h)
    attn = attend(q, st.k, st.v, st.ids, st.lengths, layer.scale)
    out = layer.back(x, attn.reshape(k.shape[0], -1))
    ragged_decide(st, tau)
    return out
