"""Overhead of KVzap (scoring + compaction) relative to one decoder layer's attention block.

Llama-3.1-8B shapes: hidden 4096, 32 query heads, 8 KV heads, head dim 128, FFN 14336.
FLOPs are exact counts (2 x multiply-adds); times are measured with torch on the chosen device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvzap_export.bench.timing import measure

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, MLP_HIDDEN = 4096, 32, 8, 128, 14336, 512


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

    def forward(self, x, k_cache=None, v_cache=None):
        t = x.shape[0]
        q, k, v = self.qkv(x).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        q = q.view(t, HEADS, HEAD_DIM).transpose(0, 1)[None]
        k = k.view(t, KV_HEADS, HEAD_DIM).transpose(0, 1)[None]
        v = v.view(t, KV_HEADS, HEAD_DIM).transpose(0, 1)[None]
        if k_cache is not None:
            k, v = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=k_cache is None, enable_gqa=True)
        return self.o(out[0].transpose(0, 1).reshape(t, HEADS * HEAD_DIM))


def bench_overhead(device: str = "cpu", prefill=(4096,), decode_cache: int = 32768, dtype=torch.float32) -> list[dict]:
    from kvzap_export.ops import threshold_compaction
    from kvzap_export.surrogate.model import Surrogate, SurrogateConfig

    torch.manual_seed(0)
    sync = torch.cuda.synchronize if device == "cuda" else None
    block = AttentionBlock().to(device, dtype).eval()
    scorers = {v: Surrogate(SurrogateConfig(HIDDEN, KV_HEADS, 1, MLP_HIDDEN if v == "mlp" else None)).layers[0].to(device, dtype).eval()
               for v in ("linear", "mlp")}
    rows = []
    with torch.no_grad():
        cases = [("prefill", t, t) for t in prefill] + [("decode", 1, decode_cache)]
        for phase, q_len, kv_len in cases:
            x = torch.randn(q_len, HIDDEN, device=device, dtype=dtype)
            if phase == "decode":
                kc = torch.randn(1, KV_HEADS, kv_len - 1, HEAD_DIM, device=device, dtype=dtype)
                vc = torch.randn_like(kc)
                attn = measure(lambda: block(x, kc, vc), sync=sync)
            else:  # seconds per call on a CPU: one timed run after the warm-up is enough
                attn = measure(lambda: block(x), sync=sync, min_repeats=1, min_seconds=0.0)
            # Compaction: over the prompt at prefill; at decode one token leaves the window per step.
            comp_len = kv_len if phase == "prefill" else 1
            scores = torch.randn(1, KV_HEADS, comp_len, device=device)
            lengths = torch.tensor([comp_len], dtype=torch.int32, device=device)
            comp = measure(lambda: threshold_compaction(scores, lengths, 0.0, 0 if phase == "decode" else 128), sync=sync)
            for variant, scorer in scorers.items():
                score = measure(lambda: scorer(x), sync=sync)
                total = score["median_s"] + comp["median_s"]
                rows.append({
                    "benchmark": "overhead", "phase": phase, "q_len": q_len, "kv_len": kv_len, "variant": variant,
                    "attention_s": attn["median_s"], "scoring_s": score["median_s"], "compaction_s": comp["median_s"],
                    "overhead_time_pct": 100 * total / attn["median_s"],
                    "scoring_flops_pct_of_attention": 100 * scoring_flops(q_len, variant) / attention_flops(q_len, kv_len, phase == "prefill"),
                    "scoring_flops_pct_of_layer_linear": 100 * scoring_flops(q_len, variant) / layer_linear_flops(q_len),
                })
    return rows
