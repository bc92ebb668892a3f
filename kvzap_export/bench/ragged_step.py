"""A pure-torch model of one Llama-3.1-8B decoder layer's decode step, dense vs ragged (docs/ragged-kv.md), as
``scripts/bench_ragged_decode.py`` times it. Runs on any device (the benchmark: CUDA, in CUDA graphs; its tests:
CPU tensors in float32).

- layouts: each KV head's kept length (``kept_lengths``) and its entries shuffled in one pool (``pool_layout``);
- the layer (``Layer``: RMSNorm, QKV, attention, O, RMSNorm, SwiGLU FFN; random weights; no rotary embedding, which
  both modes would pay alike) and the KVzap MLP surrogate (hidden -> 512 -> kv_heads, GELU) that scores each token;
- dense (``dense_step``): K/V written at the end of a full [B, kv_heads, T, D] cache, attention over every entry
  (SDPA, or any ``attend(q, k, v, scale)`` over the cache, e.g. ``DenseThroughKernel``: SGLang's decode kernel);
- ragged (``ragged_step`` on a ``RaggedState``): K/V in one-head stores ([E, D] K and V, scores [E]) addressed by
  int32 entry ids per head; the token's K/V and its surrogate score written at preallocated entry ids, the token
  appended to its rows, attention through the given ``attend(q, k, v, ids, lengths, scale)`` callable (the torch
  formula of ``kernels.ragged_attention``; ``StepAttention``: the engine's path, ``kernels.flattened_step``), then
  the decision for the entry leaving the ``WINDOW``-token window through the engine's own call
  (``kernels.decode_decision.decide_table``, what ``RaggedStore.decide_decode`` runs: its Triton kernel on CUDA, its
  torch formula elsewhere): tested against tau and removed from its row if evicted, evicted ids pushed on the free
  stack and the next step's ids popped (``recycle``: the store's ``push`` and ``pop``). All on the device, no read-back: a step can be captured in a CUDA
  graph;
- the replay check (``replay_against_eager``): the ragged step captured once and replayed, against the same steps run
  eagerly from the same state.

Defaults are Llama-3.1-8B's shapes in bf16 on CUDA (the module constants below); every one is a parameter.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvzap_export.kernels import decode_decision

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


def dense_step(layer: Layer, k_cache, v_cache, x, attend=None):
    """K/V written at the last position of full caches [B, H, T, D]; attention over every entry: SDPA with each
    group's query heads as query positions (no mask: a decode query sees every entry), or ``attend(q, k_cache,
    v_cache, scale)`` (q [B, q_heads, D]) when given."""
    _, q, k, v = layer.front(x)
    B, H = k.shape[0], k.shape[1]
    k_cache[:, :, -1] = k
    v_cache[:, :, -1] = v
    if attend is None:
        attn = F.scaled_dot_product_attention(q.reshape(B, H, -1, q.shape[-1]), k_cache, v_cache, scale=layer.scale)
    else:
        attn = attend(q, k_cache, v_cache, layer.scale)
    return layer.back(x, attn.reshape(B, -1))


def sdpa_grouped(q, k, v, scale):
    """Dense SDPA over a [B, 8, T, D] cache, each group's 4 query heads as 4 query positions of its KV head."""
    B, Hq, D = q.shape
    return F.scaled_dot_product_attention(q.reshape(B, k.shape[1], Hq // k.shape[1], D), k, v, scale=scale)


def sdpa_gqa(q, k, v, scale):
    """Dense SDPA over a [B, 8, T, D] cache, 32 query heads of one position each, ``enable_gqa``."""
    return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)


def dense_variants() -> dict:
    """The SDPA layouts this torch runs ({name: fn(q, k, v, scale)}): their speeds differ by batch (SDPA picks its
    kernel by shape), so each is timed and the fastest taken."""
    fns = {"sdpa-dense": sdpa_grouped}
    q = torch.zeros(1, Q_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    k = torch.zeros(1, KV_HEADS, 8, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    try:
        sdpa_gqa(q, k, k, 1.0)
    except (TypeError, RuntimeError):  # no enable_gqa in this torch, or no kernel for it here
        return fns
    return {**fns, "sdpa-gqa": sdpa_gqa}


class StepAttention:
    """Ragged decode attention as the engine runs it (``integrations/sglang/ragged_decode.py``): the rows laid out by
    ``kernels.flattened_step.FlattenedStep`` (its Triton id copy on CUDA), then SGLang's decode kernel over them.
    Called like ``attend(q, k, v, ids, lengths, scale)`` with ids [B, H, W] and lengths [B, H]. The engine lays out
    every layer's rows once per step, outside its graph; a call here lays out this one layer's rows first (inside
    the graph when captured): at least the engine's per-layer share of that work. ``fill`` and ``attend`` apart time
    the two. ``out``: the last call's output buffer [max_batch, q_heads, D]."""

    def __init__(self, max_batch, kv_heads, group, head_dim, entries, *, dtype, device, kernels, max_kv_splits=32,
                 use_triton=None, small_batch_splits=None):
        from kvzap_export.kernels.flattened_step import FlattenedStep

        self.step = FlattenedStep(1, max_batch, kv_heads, group, head_dim, entries, dtype=dtype, device=device,
                                  kernels=kernels, max_kv_splits=max_kv_splits, use_triton=use_triton,
                                  small_batch_splits=small_batch_splits)
        self.slots = torch.arange(max_batch, dtype=torch.int64, device=device)
        self.out = torch.zeros(max_batch, kv_heads * group, head_dim, dtype=dtype, device=device)

    def fill(self, ids, lengths) -> None:
        B, H, W = ids.shape
        self.step.fill(ids.view(B, 1, H, W), lengths.view(B, 1, H), self.slots[:B], W)

    def attend(self, q, k, v, scale):
        return self.step.attend(0, q, k, v, scale, self.out[: q.shape[0]])

    def __call__(self, q, k, v, ids, lengths, scale):
        self.fill(ids, lengths)
        return self.attend(q, k, v, scale)


class DenseThroughKernel:
    """Dense decode attention through SGLang's decode kernel: every (request, KV head) of a full cache [B, H, T, D]
    one row of all T entries (the cache read in place), laid out once; ``attend(q, k_cache, v_cache, scale)`` as
    ``dense_step`` takes it. Another dense baseline beside SDPA's layouts (``dense_variants``)."""

    def __init__(self, batch, kv_heads, group, head_dim, seq, *, dtype, device, kernels, max_kv_splits=32,
                 use_triton=None, small_batch_splits=None):
        entries = batch * kv_heads * seq
        self.rows = StepAttention(batch, kv_heads, group, head_dim, entries, dtype=dtype, device=device,
                                  kernels=kernels, max_kv_splits=max_kv_splits, use_triton=use_triton,
                                  small_batch_splits=small_batch_splits)
        ids = torch.arange(entries, dtype=torch.int32, device=device).view(batch, kv_heads, seq)
        self.rows.fill(ids, torch.full((batch, kv_heads), seq, dtype=torch.int32, device=device))

    def __call__(self, q, k_cache, v_cache, scale):
        D = k_cache.shape[-1]
        return self.rows.attend(q, k_cache.view(-1, D), v_cache.view(-1, D), scale)


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
        width = W + spare_steps + 2  # room to append
        # the rows in one flat buffer with a scratch cell past them, as the engine's RowTable holds them (dense here)
        self.data = torch.zeros(B * H * width + 1, dtype=ids.dtype, device=device)
        self.data[:-1].view(B, H, width)[..., :W] = ids
        self.base = (torch.arange(B * H, device=device) * width).view(B, 1, H)
        self.lengths = lengths.clone().to(torch.int32)
        self.free = torch.cat([torch.arange(E - 1, total - 1, -1, device=device), torch.zeros(total + 1, device=device,
                                                                                                dtype=torch.int64)])
        self.free = self.free.to(torch.int32)
        self.top = torch.full((1,), E - total, dtype=torch.int64, device=device)
        self.fresh = torch.zeros(B, H, dtype=torch.int32, device=device)
        self.slots = torch.arange(B, device=device)  # the table slots deciding: every request, every step
        self.leaving = torch.ones(B, dtype=torch.int32, device=device)  # every row appends a token per step
        self.freed = torch.full((B * H,), -1, dtype=torch.int32, device=device)  # a decision's evicted id per row
        decode_decision.recycle(self.freed, self.free, self.top, self.fresh)  # the first step's ids

    @property
    def ids(self) -> torch.Tensor:
        """int32 [B, H, W]: the rows, a view of ``data`` (without its scratch cell)."""
        B, H = self.lengths.shape
        return self.data[:-1].view(B, H, -1)

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


def ragged_decide(st: RaggedState, tau: float, use_triton: bool | None = None) -> None:
    """The entry that left the window (row index length - window - 1; undecided entries are all held) tested against
    tau and removed from its row if evicted, evicted ids pushed on the free stack, the next step's ids popped: the
    engine's calls (``decode_decision.decide_table`` over the [B, 1, H, W] table, as ``RaggedStore.decide_decode``;
    ``recycle``, the store's push and pop); ``use_triton``: decide_table's path (default: the kernel on CUDA)."""
    freed = decode_decision.decide_table(st.scores, st.data, st.base, st.lengths[:, None], st.slots, st.leaving, tau,
                                         WINDOW, use_triton)
    st.freed.copy_(freed.view(-1))
    decode_decision.recycle(st.freed, st.free, st.top, st.fresh)


def ragged_step(layer: Layer, st: RaggedState, x, attend, tau: float, use_triton: bool | None = None):
    """One decode step of the ragged mode (see the module docstring); ``attend(q, k, v, ids, lengths, scale)``;
    ``use_triton``: the decision's path (``ragged_decide``)."""
    h, q, k, v = layer.front(x)
    ragged_write(st, k, v)
    ragged_score(layer, st, h)
    attn = attend(q, st.k, st.v, st.ids, st.lengths, layer.scale)
    out = layer.back(x, attn.reshape(k.shape[0], -1))
    ragged_decide(st, tau, use_triton)
    return out


def replay_against_eager(layer: Layer, st: RaggedState, flat, x, tau: float, steps: int, graphed) -> dict:
    """``ragged_step`` captured once (``graphed(fn)`` -> (graph, its output)) and replayed ``steps`` times, against the
    same steps run eagerly from the same state (random inputs written into ``x``; ``flat``: the step's attention,
    whose ``out`` buffer holds its output). Returns the replay's figures: bookkeeping (lengths, held ids, free stack,
    next ids) equal, the largest differences of attention, the layer's output and the K/V/score stores, the rows'
    growth, and ``passed`` (bookkeeping equal, every difference within 1e-2)."""
    inputs = torch.randn(steps, *x.shape, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(5))
    inputs = inputs.to(DTYPE)
    initial = st.clone()
    graph, static_out = graphed(lambda: ragged_step(layer, st, x, flat, tau))
    st.copy_(initial)  # the warm-ups stepped it: back to the start, same buffers
    graph_out = []
    for t in range(steps):
        x.copy_(inputs[t])
        graph.replay()
        graph_out.append((flat.out.clone(), static_out.clone()))  # attention's output, the layer's output
    graph_state = st.clone()
    st.copy_(initial)
    eager_out = []
    for t in range(steps):
        x.copy_(inputs[t])
        out = ragged_step(layer, st, x, flat, tau)
        eager_out.append((flat.out.clone(), out))
    held = torch.arange(st.ids.shape[-1], device=st.ids.device) < st.lengths[..., None]
    top = int(st.top)
    same_state = bool(torch.equal(st.lengths, graph_state.lengths) and torch.equal(st.ids[held], graph_state.ids[held])
                      and torch.equal(st.top, graph_state.top) and torch.equal(st.fresh, graph_state.fresh)
                      and torch.equal(st.free[:top], graph_state.free[:top]))
    stores = max((getattr(st, n).float() - getattr(graph_state, n).float()).abs().max().item()
                 for n in ("k", "v", "scores"))
    diff = [max((e[i].float() - r[i].float()).abs().max().item() for e, r in zip(eager_out, graph_out)) for i in (0, 1)]
    grown = (st.lengths - initial.lengths).float()
    return dict(max_abs_diff_attention=diff[0], max_abs_diff_layer=diff[1], bookkeeping_equal=same_state,
                stores_max_abs_diff=stores, mean_length_growth=grown.mean().item(),
                min_length_growth=grown.min().item(), evicted_fraction=1 - grown.mean().item() / steps,
                passed=same_state and max(diff + [stores]) <= 1e-2)
