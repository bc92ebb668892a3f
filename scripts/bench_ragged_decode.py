#!/usr/bin/env python
"""GPU benchmark of ragged decode attention (docs/ragged-kv.md) and of one decoder layer's decode step, dense vs
ragged, in CUDA graphs. Llama-3.1-8B shapes: 32 query heads, 8 KV heads, head dim 128, hidden 4096, FFN 14336, bf16.

    python scripts/bench_ragged_decode.py --json out.json --sglang-kernels sglang-0.5.23-....whl

Sections (each in try/except: an error is recorded in the JSON and the next section runs):

- exactness: every attention kernel timed here against ``ragged_attention.ragged_decode_attention`` (the float32
  formula) on one small case with ragged lengths and empty heads;
- attention: batch 1/16/64 x T 4096/32768 x pruned 0.4/0.7: dense SDPA over every entry ([B, 8, T, 128], the 4 query
  heads of a group as 4 query positions), SDPA over dense tensors of the kept length (the ideal), SGLang's decode
  kernel over the flattened rows (``FlattenedDecode``: layout fill + kernel, and the kernel alone; split settings
  swept at a few rows), our first Triton ragged kernel at a few rows (slow: few repetitions). Each head keeps a
  length drawn within +-25% of the mean, its entries shuffled in one pool ([E, 128] K and V stores);
- layer: one decoder layer (RMSNorm, QKV, attention, O, RMSNorm, SwiGLU FFN; random bf16 weights; no rotary
  embedding, which both sides would pay alike) at decode, dense
  (K/V written at the end of a full [B, 8, T, 128] cache, SDPA) vs ragged (K/V and the surrogate score written at
  preallocated entry ids, the token appended to its rows, attention through the flattened kernel, the entry leaving
  the 128-token window tested against tau and removed if evicted, evicted ids pushed on the free stack and the next
  step's ids popped), each captured in one CUDA graph and replayed; eager times too;
- replay: 50 steps of the captured ragged step (lengths growing, heads pruned) against the same 50 steps run eagerly
  from the same starting state: the bookkeeping (ids, lengths, free stack top, next ids) must be equal, the attention
  and layer outputs and the K/V/score stores within 1e-2 (max abs differences recorded).

The flattened kernel's default configuration (the one the targets read): split policy "proportional", at most
``SPLITS`` = 32 splits per row (``kernels/flattened_attention.py``). Rows past ``--budget-s`` seconds are skipped
(listed under "skipped").

Timing: CUDA events, warm-ups, a 256 MiB write between calls (L2 flush), median of --reps; effective GB/s counts K
and V rows read once (plus int32 ids for the ragged kernels). Targets are printed and recorded (informational).
Without a CUDA GPU: one line, exit 2. Exit 1 if an exactness or replay check failed, 3 if a section raised.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, HIDDEN, FFN, SURROGATE_HIDDEN, WINDOW = 32, 8, 128, 4096, 14336, 512, 128
ATTENTION_GRID = [(b, t, p) for b in (1, 16, 64) for t in (4096, 32768) for p in (0.4, 0.7)]
OLD_KERNEL_ROWS = {(1, 32768, 0.7), (16, 32768, 0.7), (64, 4096, 0.7)}
SWEEP_ROWS = {(1, 32768, 0.7): [("max", 32), ("proportional", 64), ("max", 64)],
              (16, 32768, 0.7): [("max", 32), ("proportional", 64)], (16, 32768, 0.4): [("max", 32)]}
LAYER_GRID = [(16, 32768, 0.4), (16, 32768, 0.7), (1, 32768, 0.7), (64, 4096, 0.7), (1, 32768, 0.4), (64, 4096, 0.4)]
TARGETS = [("attention", 16, 32768, 0.7, 0.5), ("attention", 16, 32768, 0.4, 0.8), ("attention", 1, 32768, 0.7, 1.0),
           ("layer", 16, 32768, 0.7, 0.65), ("layer", 16, 32768, 0.4, 0.95)]
HEADROOM = 64  # steps of room in every row and the pool (warm-ups, repetitions, replays)
EXACT_CASE = (3, 32768, 0.4)  # batch, T, pruned of the exactness check
REPLAY_CASE = (4, 4096, 0.7, 50)  # batch, T, pruned, steps of the replay check
SPLITS = 32  # max_kv_splits of the default flattened configuration (proportional policy)
DEVICE, DTYPE, FLUSH_BYTES = "cuda", torch.bfloat16, 256 << 20


def device_name() -> str:
    return torch.cuda.get_device_name()


def free_memory() -> int:
    return torch.cuda.mem_get_info()[0]


def allocation_count() -> int:
    return torch.cuda.memory_stats()["allocation.all.allocated"]


def release() -> None:
    """Hands cached blocks back between rows (batch 64 x 32k holds gigabytes)."""
    torch.cuda.empty_cache()


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


def ragged_step(layer: Layer, st: RaggedState, x, attend, tau: float):
    """One decode step of the ragged mode (see the module docstring); ``attend(q, k, v, ids, lengths, scale)``."""
    h, q, k, v = layer.front(x)
    B, H, D = k.shape
    fresh = st.fresh.view(-1).to(torch.int64)
    st.k.index_copy_(0, fresh, k.reshape(B * H, D))
    st.v.index_copy_(0, fresh, v.reshape(B * H, D))
    st.scores.index_copy_(0, fresh, layer.scores(h).reshape(-1).to(st.scores.dtype))
    st.ids.scatter_(2, st.lengths.to(torch.int64)[..., None], st.fresh[..., None])  # append the token
    st.lengths.add_(1)
    attn = attend(q, st.k, st.v, st.ids, st.lengths, layer.scale)
    out = layer.back(x, attn.reshape(B, -1))
    # the entry that left the window: row index length - window - 1 (undecided entries are all held)
    start = st.lengths.to(torch.int64) - WINDOW - 1
    columns = start.clamp(min=0)[..., None] + torch.arange(WINDOW + 1, device=x.device)
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
    return out


# ---- measuring -------------------------------------------------------------------------------------------------
def timer(flush, warmup: int, reps: int):
    def measure(fn) -> float:
        """Median seconds of ``fn()`` (CUDA events, L2 flushed before each)."""
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    return measure


def graphed(fn):
    """``fn`` captured in a CUDA graph (after two warm-up calls on a side stream); returns (graph, its output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


class Bench:
    def __init__(self, args, kernels):
        from kvzap_export.kernels.flattened_attention import FlattenedDecode

        self.args, self.kernels, self.FlattenedDecode = args, kernels, FlattenedDecode
        self.device_name = device_name()
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=DEVICE)
        self.measure = timer(self.flush, args.warmup, args.reps)
        self.started = time.perf_counter()
        self.report = {"device": self.device_name, "torch": torch.__version__, "cuda": torch.version.cuda,
                       "kernel_source": kernels.source.as_dict(), "exactness": [], "attention": [], "layer": [],
                       "replay": None, "targets": [], "errors": [], "skipped": []}

    def over_budget(self) -> bool:
        return time.perf_counter() - self.started > self.args.budget_s

    def flattened(self, batch, width, policy="proportional", splits=None):
        splits = splits or SPLITS
        return self.FlattenedDecode(batch, KV_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM, width, dtype=DTYPE,
                                    device=DEVICE, max_kv_splits=splits, split_policy=policy, kernels=self.kernels)

    def row(self, **fields):
        return {"device": self.device_name, **fields}

    # -- exactness ---------------------------------------------------------------------------------------------
    def exactness(self):
        from kvzap_export.kernels.ragged_attention import ragged_decode_attention
        from kvzap_export.kernels.triton_ragged_attention import ragged_decode_attention_triton

        g = torch.Generator(device=DEVICE).manual_seed(1)
        batch, seq, pruned = EXACT_CASE
        lengths = kept_lengths(batch, KV_HEADS, seq, pruned, g)
        lengths[0, -1], lengths[-1] = 0, 0  # an empty head, an empty request
        ids, total = pool_layout(lengths, int(lengths.max()), g)
        k = torch.randn(total, HEAD_DIM, device=DEVICE, generator=g, dtype=DTYPE)
        v = torch.randn(total, HEAD_DIM, device=DEVICE, generator=g, dtype=DTYPE)
        q = (3 * torch.randn(batch, Q_HEADS, HEAD_DIM, device=DEVICE, generator=g)).to(DTYPE)  # peaked softmax
        want = ragged_decode_attention(q, k, v, ids, lengths, 1 / math.sqrt(HEAD_DIM)).float()
        kernels = {f"sglang-flattened {p} splits {s}": self.flattened(batch, ids.shape[-1], p, s)
                   for p, s in [("proportional", SPLITS), ("max", SPLITS), ("proportional", 2 * SPLITS)]}
        kernels["triton-ragged (ours)"] = ragged_decode_attention_triton
        for name, fn in kernels.items():
            got = fn(q, k, v, ids, lengths, 1 / math.sqrt(HEAD_DIM)).float()
            err = (got - want).abs()
            ok = bool(torch.isfinite(got).all()) and bool((err <= 2e-3 + 2e-2 * want.abs()).all())
            case = f"batch {batch}, T {seq}, pruned {pruned}, empty heads"
            self.report["exactness"].append(self.row(kernel=name, case=case, max_abs_err=err.max().item(),
                                                     max_abs_ref=want.abs().max().item(), passed=ok))

    # -- attention ---------------------------------------------------------------------------------------------
    def attention(self):
        from kvzap_export.kernels.triton_ragged_attention import ragged_decode_attention_triton

        scale = 1 / math.sqrt(HEAD_DIM)
        for batch, seq in sorted({(b, t) for b, t, _ in ATTENTION_GRID}):
            need = 2 * batch * KV_HEADS * seq * HEAD_DIM * 2 * 2.5  # dense K/V, the pool, the kept tensors
            if need > free_memory() or self.over_budget():
                self.report["skipped"].append(f"attention batch {batch} T {seq}: memory or time budget")
                continue
            g = torch.Generator(device=DEVICE).manual_seed(batch * seq)
            kd = torch.randn(batch, KV_HEADS, seq, HEAD_DIM, device=DEVICE, generator=g, dtype=DTYPE)
            vd = torch.randn_like(kd)
            q = torch.randn(batch, Q_HEADS, HEAD_DIM, device=DEVICE, generator=g).to(DTYPE)
            qd = q.view(batch, KV_HEADS, -1, HEAD_DIM)
            dense = self.measure(lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale))
            dense_bytes = 2 * batch * KV_HEADS * seq * HEAD_DIM * 2
            self.report["attention"].append(self.row(kernel="sdpa-dense", batch=batch, seq=seq, pruned=0.0,
                                                     time_us=dense * 1e6, gbps=dense_bytes / dense / 1e9, ratio=1.0))
            for pruned in (0.4, 0.7):
                lengths = kept_lengths(batch, KV_HEADS, seq, pruned, g)
                ids, total = pool_layout(lengths, int(lengths.max()), g)
                ks = torch.randn(total, HEAD_DIM, device=DEVICE, generator=g, dtype=DTYPE)
                vs = torch.randn_like(ks)
                kept = round((1 - pruned) * seq)
                base = dict(batch=batch, seq=seq, pruned=pruned, entries=total)
                ideal = self.measure(lambda: F.scaled_dot_product_attention(qd, kd[:, :, :kept], vd[:, :, :kept],
                                                                            scale=scale))
                self.report["attention"].append(self.row(kernel="sdpa-kept", **base, time_us=ideal * 1e6,
                                                         ratio=ideal / dense, gbps=dense_bytes * kept / seq / ideal / 1e9))
                configs = [("proportional", SPLITS)] + SWEEP_ROWS.get((batch, seq, pruned), [])
                ragged_bytes = total * (2 * HEAD_DIM * 2 + 4)
                for policy, splits in configs:
                    flat = self.flattened(batch, ids.shape[-1], policy, splits)
                    both = self.measure(lambda: flat(q, ks, vs, ids, lengths, scale))
                    flat.fill(ids, lengths)
                    alone = self.measure(lambda: flat.attend(q, ks, vs, scale))
                    before = allocation_count()
                    flat(q, ks, vs, ids, lengths, scale)
                    allocations = allocation_count() - before
                    self.report["attention"].append(self.row(
                        kernel="sglang-flattened", policy=policy, max_kv_splits=splits, **base, time_us=both * 1e6,
                        kernel_only_us=alone * 1e6, ratio=both / dense, gbps=ragged_bytes / both / 1e9,
                        allocations_per_call=allocations, default=(policy, splits) == ("proportional", SPLITS)))
                    del flat
                if (batch, seq, pruned) in OLD_KERNEL_ROWS and not self.over_budget():
                    slow = lambda: ragged_decode_attention_triton(q, ks, vs, ids, lengths, scale)  # noqa: E731
                    old = timer(self.flush, 1, 5)(slow)
                    self.report["attention"].append(self.row(kernel="triton-ragged (ours)", **base, time_us=old * 1e6,
                                                             ratio=old / dense, gbps=ragged_bytes / old / 1e9))
                del ks, vs, ids
            del kd, vd
            release()

    # -- one layer's step ----------------------------------------------------------------------------------------
    def ragged_setup(self, batch, seq, pruned, seed):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        lengths = kept_lengths(batch, KV_HEADS, seq, pruned, g).clamp(min=WINDOW + 1)
        ids, total = pool_layout(lengths, int(lengths.max()), g)
        steps = 4 * (self.args.warmup + self.args.reps) + 60  # every call below appends one token per head
        st = RaggedState(lengths, ids, total, HEAD_DIM, DTYPE, g, spare_steps=steps)
        flat = self.flattened(batch, st.ids.shape[-1])
        x = torch.randn(batch, HIDDEN, device=DEVICE, generator=g).to(DTYPE)
        return st, flat, x

    def layer(self):
        layer = Layer()
        for batch, seq, pruned in LAYER_GRID:
            if self.over_budget():
                self.report["skipped"].append(f"layer batch {batch} T {seq} pruned {pruned}: time budget")
                continue
            g = torch.Generator(device=DEVICE).manual_seed(7)
            kd = torch.randn(batch, KV_HEADS, seq, HEAD_DIM, device=DEVICE, generator=g, dtype=DTYPE)
            vd = torch.randn_like(kd)
            st, flat, x = self.ragged_setup(batch, seq, pruned, 8)
            dense_fn = lambda: dense_step(layer, kd, vd, x)  # noqa: E731
            ragged_fn = lambda: ragged_step(layer, st, x, flat, self.args.tau)  # noqa: E731
            dense_eager, ragged_eager = self.measure(dense_fn), self.measure(ragged_fn)
            (dense_graph, _), (ragged_graph, _) = graphed(dense_fn), graphed(ragged_fn)
            dense_g, ragged_g = self.measure(dense_graph.replay), self.measure(ragged_graph.replay)
            self.report["layer"].append(self.row(
                kernel="sglang-flattened", batch=batch, seq=seq, pruned=pruned, entries=int(st.lengths.sum()),
                dense_graph_us=dense_g * 1e6, ragged_graph_us=ragged_g * 1e6, ratio=ragged_g / dense_g,
                dense_eager_us=dense_eager * 1e6, ragged_eager_us=ragged_eager * 1e6,
                ratio_eager=ragged_eager / dense_eager))
            del kd, vd, st, flat, dense_graph, ragged_graph
            release()

    def replay(self):
        """The captured ragged step replayed ``steps`` times vs the same steps eagerly on a copy of the state."""
        layer = Layer(seed=3)
        batch, seq, pruned, steps = REPLAY_CASE
        st, flat, x = self.ragged_setup(batch, seq, pruned, 11)
        inputs = torch.randn(steps, *x.shape, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(5))
        inputs = inputs.to(DTYPE)
        initial = st.clone()
        graph, static_out = graphed(lambda: ragged_step(layer, st, x, flat, self.args.tau))
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
            out = ragged_step(layer, st, x, flat, self.args.tau)
            eager_out.append((flat.out.clone(), out))
        held = torch.arange(st.ids.shape[-1], device=DEVICE) < st.lengths[..., None]
        same_state = bool(torch.equal(st.lengths, graph_state.lengths)
                          and torch.equal(st.ids[held], graph_state.ids[held])
                          and torch.equal(st.top, graph_state.top) and torch.equal(st.fresh, graph_state.fresh))
        stores = max((getattr(st, n).float() - getattr(graph_state, n).float()).abs().max().item()
                     for n in ("k", "v", "scores"))
        diff = [max((e[i].float() - r[i].float()).abs().max().item() for e, r in zip(eager_out, graph_out))
                for i in (0, 1)]
        grown = (st.lengths - initial.lengths).float()
        self.report["replay"] = self.row(kernel="sglang-flattened", batch=batch, seq=seq, pruned=pruned, steps=steps,
                                         max_abs_diff_attention=diff[0], max_abs_diff_layer=diff[1],
                                         bookkeeping_equal=same_state, stores_max_abs_diff=stores,
                                         mean_length_growth=grown.mean().item(), min_length_growth=grown.min().item(),
                                         evicted_fraction=1 - grown.mean().item() / steps,
                                         passed=same_state and max(diff + [stores]) <= 1e-2)

    def targets(self):
        for section, batch, seq, pruned, limit in TARGETS:
            rows = [r for r in self.report[section] if (r["batch"], r["seq"], r["pruned"]) == (batch, seq, pruned)
                    and (section == "layer" or r.get("default"))]
            value = rows[0]["ratio"] if rows else None
            name = f"{section} batch {batch} T {seq} pruned {pruned}: ragged/dense <= {limit}"
            self.report["targets"].append({"device": self.device_name, "name": name, "value": value, "limit": limit,
                                           "passed": None if value is None else value <= limit})


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--sglang-kernels", help="the sglang 0.5.23 wheel or a directory holding sglang/kernels/ops/"
                                                 "attention/decode_attention.py (default: the installed sglang)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tau", type=float, default=0.0, help="threshold of the layer step's decisions")
    parser.add_argument("--budget-s", type=float, default=110.0, help="skip remaining rows past this many seconds")
    parser.add_argument("--only", default="exactness,attention,layer,replay")
    return parser.parse_args(argv)


def print_report(report):
    source = report["kernel_source"]
    print(f"# {report['device']} — kernel source: {source['origin']} {source['location']} "
          f"(stood in: {', '.join(source['stood_in']) or 'none'})")
    for row in report["exactness"]:
        print(f"exact {row['kernel']:<38} max err {row['max_abs_err']:.2e} (ref {row['max_abs_ref']:.2f}) "
              f"{'ok' if row['passed'] else 'FAILED'}")
    for row in report["attention"]:
        extra = f" {row.get('policy', '')} {row.get('max_kv_splits', '')}".rstrip()
        print(f"attn  b{row['batch']:<3} T{row['seq']:<6} p{row['pruned']:<4} {row['kernel'] + extra:<38} "
              f"{row['time_us']:9.1f} us  x{row['ratio']:.2f} dense  {row['gbps']:7.0f} GB/s")
    for row in report["layer"]:
        print(f"layer b{row['batch']:<3} T{row['seq']:<6} p{row['pruned']:<4} graphed dense {row['dense_graph_us']:.0f} us "
              f"ragged {row['ragged_graph_us']:.0f} us x{row['ratio']:.2f}; eager {row['dense_eager_us']:.0f} / "
              f"{row['ragged_eager_us']:.0f} us")
    if report["replay"]:
        print(f"replay {report['replay']}")
    for target in report["targets"]:
        print(f"target {target['name']}: {target['value']} -> {target['passed']}")
    for error in report["errors"]:
        print(f"ERROR in {error['section']}: {error['error']}")


def run(args, kernels) -> tuple[dict, int]:
    """Every section of ``args.only``, each in try/except; returns (report, exit code: 1 if an exactness or replay
    check failed, 3 if a section raised, else 0). With ``--json`` the report is written after every section, so a
    run stopped from outside keeps what it measured."""
    bench = Bench(args, kernels)
    for section in args.only.split(","):
        try:
            getattr(bench, section)()
        except Exception as error:  # noqa: BLE001 - recorded, the next section runs
            bench.report["errors"].append({"section": section, "error": f"{type(error).__name__}: {error}",
                                           "traceback": traceback.format_exc()})
            release()
        if args.json:
            args.json.write_text(json.dumps({**bench.report, "partial": True}, indent=2))
    bench.targets()
    bench.report["elapsed_s"] = time.perf_counter() - bench.started
    replay = bench.report["replay"]
    exact = [r["passed"] for r in bench.report["exactness"]] + ([replay["passed"]] if replay else [])
    return bench.report, 1 if not all(exact) else 3 if bench.report["errors"] else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ragged_decode: needs a CUDA GPU; none is visible to torch on this machine", file=sys.stderr)
        return 2
    from kvzap_export.errors import KvzapError
    from kvzap_export.kernels import sglang_kernels

    try:
        kernels = sglang_kernels.load(args.sglang_kernels)
    except KvzapError as error:
        print(f"bench_ragged_decode: {error}", file=sys.stderr)
        return 2
    report, code = run(args, kernels)
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return code


if __name__ == "__main__":
    sys.exit(main())
