"""Overhead of KVzap next to one decoder layer's attention block: what an engine runs, timed as it runs it.

Llama-3.1-8B shapes: hidden 4096, 32 query heads, 8 KV heads, head dim 128, FFN 14336; batch 1. At the model's
dtype on a GPU (bfloat16: SDPA takes its flash path; float32 would fall to the math path and, at 32k prefill, ask
for 128 GiB) and float32 on a CPU.

- prefill (T tokens): the attention block over the prompt vs scoring the T tokens + the fused compaction of the
  prompt's decisions (on a GPU the Triton launcher and the CUDA library's, no validation and no host sync, as an
  engine calls them; on a CPU the reference op the engines' CPU path calls);
- decode (one token over a T-token cache written in place): the attention block vs scoring the token + the
  per-step decision (``kernels.decode_decision``: the token that left the window tested against τ and taken out
  of its row, for each KV head) — not a whole compaction: one token leaves the window per step. On a GPU both
  sides are also timed inside CUDA graphs (what a serving engine replays at decode; eager, one token's scoring is
  launch-bound) and the overhead is given both ways.

Times: on a GPU, CUDA events around back-to-back calls (the steady state of a serving loop; as many as last about
2 ms), median of 15; on a CPU, wall clock, median. Scoring and the decision are timed over ``LAYERS`` layers' own
weights and rows per call and divided by ``LAYERS``, so that, as in an engine, a layer's surrogate weights are not
still in the L2 cache from the previous call (32 MLP surrogates of Llama-3.1-8B hold 128 MiB in bf16; an H100's L2
holds 50 MB); the attention block reads 84 MB of weights and, at decode, a 134 MB cache every call anyway. On a
GPU scoring and the decision are each their own CUDA graph (two replays where an engine would have none inside its
decode graph: against KVzap). FLOPs are exact counts (2 x multiply-adds). Rows a machine cannot run (no GPU, no
nvcc) are kept with ``skipped`` and the reason.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvzap_export.bench.timing import capture_graph, measure, measure_cuda

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, MLP_HIDDEN = 4096, 32, 8, 128, 14336, 512
THRESHOLD, WINDOW = -4.0, 128
LAYERS = 32  # Llama-3.1-8B's: scoring and decisions are timed over this many layers' own weights and rows


def attention_flops(q_len: int, kv_len: int, causal: bool) -> int:
    proj = 2 * q_len * HIDDEN * (HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM) + 2 * q_len * HEADS * HEAD_DIM * HIDDEN
    pairs = q_len * kv_len - (q_len * (q_len - 1)) // 2 if causal else q_len * kv_len
    return proj + 2 * 2 * HEADS * HEAD_DIM * pairs


def layer_linear_flops(tokens: int) -> int:
    """All linear projections of one decoder layer (attention + gated FFN), the paper's denominator."""
    return 2 * tokens * HIDDEN * (HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM) + 2 * tokens * HEADS * HEAD_DIM * HIDDEN \
        + 3 * 2 * tokens * HIDDEN * FFN


def scoring_flops(tokens: int, variant: str) -> int:
    return 2 * tokens * HIDDEN * KV_HEADS if variant == "linear" else 2 * tokens * (HIDDEN * MLP_HIDDEN + MLP_HIDDEN * KV_HEADS)


class AttentionBlock(torch.nn.Module):
    """q/k/v/o projections + causal GQA SDPA (RoPE and norms omitted: O(T) and small)."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=False)
        self.o = torch.nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)

    def _project(self, x):
        t = x.shape[0]
        q, k, v = self.qkv(x).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        return (q.view(t, HEADS, HEAD_DIM).transpose(0, 1)[None], k.view(t, KV_HEADS, HEAD_DIM).transpose(0, 1)[None],
                v.view(t, KV_HEADS, HEAD_DIM).transpose(0, 1)[None])

    def forward(self, x):
        """Prefill: x [T, hidden], causal attention over its own K/V."""
        q, k, v = self._project(x)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(out[0].transpose(0, 1).reshape(x.shape[0], HEADS * HEAD_DIM))

    def decode(self, x, k_cache, v_cache):
        """Decode: x [1, hidden]; its K/V written in place at the cache's last position, attention over the cache
        (k_cache, v_cache [1, kv_heads, T, head_dim]), as an engine's preallocated cache does."""
        q, k, v = self._project(x)
        k_cache[:, :, -1:].copy_(k)
        v_cache[:, :, -1:].copy_(v)
        out = F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)
        return self.o(out[0].transpose(0, 1).reshape(1, HEADS * HEAD_DIM))


def graphed(fn):
    """``fn`` captured in a CUDA graph (after warm-up on a side stream); returns the replay."""
    return capture_graph(fn)[0].replay


def _prefill_compactions(device: str, seq: int, dtype) -> dict:
    """Name -> a callable of the prompt's fused compaction (or the reason it cannot run here); scores in the model's
    dtype, as the surrogate writes them."""
    scores = (torch.randn(1, KV_HEADS, seq, device=device) * 2 - 4).to(dtype)
    lengths = torch.tensor([seq], dtype=torch.int32, device=device)
    if device != "cuda":
        from kvzap_export.kernels.torch_ops import threshold_compaction

        return {"torch reference (engines' CPU path)": lambda: threshold_compaction(scores, lengths, THRESHOLD, WINDOW,
                                                                                     check_lengths=False),
                "Triton fused launcher": "needs a CUDA GPU", "CUDA library fused launcher": "needs a CUDA GPU"}
    from kvzap_export.kernels.triton_compaction import launch_threshold_compaction

    out = {"Triton fused launcher": lambda: launch_threshold_compaction(scores, lengths, THRESHOLD, WINDOW)}
    from kvzap_export.validate.device import cuda_kernels

    lib = cuda_kernels("cuda")
    if isinstance(lib, str):
        out["CUDA library fused launcher"] = lib
    else:
        tau = torch.tensor(THRESHOLD, dtype=torch.float32, device=device)
        win = torch.tensor(WINDOW, dtype=torch.int32, device=device)
        out["CUDA library fused launcher"] = lambda: lib.launch_threshold_compaction(scores, lengths, tau, win)
    return out


def _decision(device: str, dtype, cache: int, layers: int):
    """The per-step decision over ``layers`` layers' rows (batch 1 x 8 KV heads each), in place, as the engine runs
    it: one ``decode_decision.decide_table`` call over the [1, layers, heads, cache] table (``RaggedStore.decide_decode``)."""
    from kvzap_export.kernels import decode_decision

    gen = torch.Generator().manual_seed(1)
    entries = KV_HEADS * cache
    scores = (torch.randn(entries, generator=gen) * 2 - 4).to(device, dtype)
    ids = torch.stack([torch.randperm(entries, generator=gen).view(KV_HEADS, cache) for _ in range(layers)])
    data = torch.cat([ids.reshape(-1), torch.zeros(1, dtype=ids.dtype)]).to(device, torch.int32)  # + a scratch cell
    base = (torch.arange(layers * KV_HEADS) * cache).view(1, layers, KV_HEADS).to(device)  # the rows, back to back
    lengths = torch.full((1, layers, KV_HEADS), cache, dtype=torch.int32, device=device)
    slots, leaving = torch.zeros(1, dtype=torch.int64, device=device), torch.ones(1, dtype=torch.int32, device=device)

    def run():
        decode_decision.decide_table(scores, data, base, lengths, slots, leaving, THRESHOLD, WINDOW)
    return ("Triton kernel" if device == "cuda" else "torch formula (engines' CPU path)"), run


def _timer(cuda: bool):
    """CUDA events over back-to-back calls on a GPU (``measure_cuda``), wall clock with a median on a CPU (keyword
    arguments: ``measure``'s, ignored on a GPU)."""
    return (lambda fn, **_: measure_cuda(fn)) if cuda else measure


def bench_overhead(device: str = "cpu", prefill=(4096,), decode_cache: int = 32768, dtype=None) -> list[dict]:
    from kvzap_export.integrations.scoring import BundleScorer
    from kvzap_export.surrogate.model import Surrogate, SurrogateConfig

    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    torch.manual_seed(0)
    cuda = device == "cuda"
    measure = _timer(cuda)
    block = AttentionBlock().to(device, dtype).eval()
    layers = LAYERS if cuda else 1  # a CPU has no L2 to defeat at these sizes; one layer keeps its run short
    scorers = {v: BundleScorer(Surrogate(SurrogateConfig(HIDDEN, KV_HEADS, layers, MLP_HIDDEN if v == "mlp" else None)))
               for v in ("linear", "mlp")}  # the engines' scoring path (functional eager calls)
    common = {"benchmark": "overhead", "dtype": str(dtype).removeprefix("torch."), "batch": 1, "layers_per_call": layers}
    rows = []
    with torch.no_grad():
        for seq in prefill:
            x = torch.randn(seq, HIDDEN, device=device, dtype=dtype)
            # seconds per call on a CPU: one timed run after the warm-up is enough
            attn = measure(lambda: block(x), min_repeats=1, min_seconds=0.0)
            compactions = _prefill_compactions(device, seq, dtype)
            for variant, scorer in scorers.items():
                score = _per_layer(measure(lambda: _score_layers(scorer, x)), scorer.num_layers)
                for name, run in compactions.items():
                    row = {**common, "phase": "prefill", "q_len": seq, "kv_len": seq, "variant": variant,
                           "compaction": name, "attention_s": attn["median_s"], "scoring_s": score["median_s"],
                           "scoring_flops_pct_of_attention": 100 * scoring_flops(seq, variant) / attention_flops(seq, seq, True),
                           "scoring_flops_pct_of_layer_linear": 100 * scoring_flops(seq, variant) / layer_linear_flops(seq)}
                    if isinstance(run, str):
                        rows.append({**row, "skipped": run})
                        continue
                    comp = measure(run)
                    rows.append({**row, "compaction_s": comp["median_s"],
                                 "overhead_time_pct": 100 * (score["median_s"] + comp["median_s"]) / attn["median_s"]})
        rows += _decode_rows(block, scorers, device, dtype, decode_cache, common)
    return rows


def _score_layers(scorer, x) -> None:
    """Scores ``x`` with every layer's own surrogate weights, as a forward does."""
    for layer in range(scorer.num_layers):
        scorer.score(layer, x)


def _per_layer(timing: dict, layers: int) -> dict:
    return {**timing, "median_s": timing["median_s"] / layers}


def _decode_rows(block, scorers, device, dtype, cache, common) -> list[dict]:
    cuda = device == "cuda"
    measure = _timer(cuda)
    layers = common["layers_per_call"]
    x = torch.randn(1, HIDDEN, device=device, dtype=dtype)
    k_cache = torch.randn(1, KV_HEADS, cache, HEAD_DIM, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    step = lambda: block.decode(x, k_cache, v_cache)  # noqa: E731
    attn = measure(step)
    decision_kind, decide = _decision(device, dtype, cache, layers)
    decision = _per_layer(measure(decide), layers)
    attn_graph = measure(graphed(step)) if cuda else None
    decision_graph = _per_layer(measure(graphed(decide)), layers) if cuda else None
    rows = []
    for variant, scorer in scorers.items():
        score_fn = lambda: _score_layers(scorer, x)  # noqa: E731
        score = _per_layer(measure(score_fn), scorer.num_layers)
        row = {**common, "phase": "decode", "q_len": 1, "kv_len": cache, "variant": variant, "decision": decision_kind,
               "attention_s": attn["median_s"], "scoring_s": score["median_s"], "decision_s": decision["median_s"],
               "overhead_time_pct": 100 * (score["median_s"] + decision["median_s"]) / attn["median_s"],
               "scoring_flops_pct_of_attention": 100 * scoring_flops(1, variant) / attention_flops(1, cache, False),
               "scoring_flops_pct_of_layer_linear": 100 * scoring_flops(1, variant) / layer_linear_flops(1)}
        if cuda:
            score_graph = _per_layer(measure(graphed(score_fn)), scorer.num_layers)
            row.update({"attention_graphed_s": attn_graph["median_s"], "scoring_graphed_s": score_graph["median_s"],
                        "decision_graphed_s": decision_graph["median_s"],
                        "overhead_graphed_time_pct": 100 * (score_graph["median_s"] + decision_graph["median_s"])
                        / attn_graph["median_s"]})
        else:
            row["graphed"] = "skipped: CUDA graphs need a CUDA GPU"
        rows.append(row)
    return rows
