"""``evaluate``: quality vs compression for KVzap, random eviction and keep-most-recent.

On held-out text, the prompt is prefilled densely (as kvpress) and its cache pruned per layer and KV
head; the continuation is then teacher-forced. Quality = next-token agreement with the full cache and
perplexity of the continuation. Baselines prune exactly as many entries per (layer, head) as KVzap
does at that threshold (equal compression), outside the same protected window.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from kvzap_export.errors import ConfigError

METHODS = ("kvzap", "random", "recent")
TEXTS = {"legal": "legal and licence texts (a held-out domain: never trained on)",
         "quotations": "quotations, jokes and verse (a held-out domain: never trained on)",
         "python-docs": "Python documentation reserved for validation (a trained-on kind of text, these topics never trained on)"}
DEFAULT_QUANTILES = (0.25, 0.45, 0.63, 0.8, 0.95)


def _baseline(kind: str, counts_pruned: torch.Tensor, evictable: int, gen: torch.Generator) -> torch.Tensor:
    """counts_pruned: (H,) -> bool (H, evictable) pruning that many per head, randomly or oldest first."""
    heads = counts_pruned.shape[0]
    pruned = torch.zeros(heads, evictable, dtype=torch.bool)
    for h in range(heads):
        n = int(counts_pruned[h])
        chosen = torch.randperm(evictable, generator=gen)[:n] if kind == "random" else torch.arange(n)
        pruned[h, chosen] = True
    return pruned


def _quality(logits: torch.Tensor, full_logits: torch.Tensor, ids: torch.Tensor, prompt_len: int) -> tuple[float, float]:
    """Next-token agreement with the full cache and NLL of the true continuation, over continuation positions."""
    sl = slice(prompt_len - 1, ids.shape[1] - 1)
    agree = (logits[0, sl].argmax(-1) == full_logits[0, sl].argmax(-1)).float().mean().item()
    nll = torch.nn.functional.cross_entropy(logits[0, sl].float(), ids[0, prompt_len:]).item()
    return agree, nll


def evaluation_texts(text: str, count: int, tokenizer, seed: int = 0) -> list[str]:
    """``count`` texts of the kind ``text`` (a key of TEXTS) that the shipped surrogates never trained on."""
    if text not in TEXTS:
        raise ConfigError(f"--text {text!r}: use one of {', '.join(TEXTS)}")
    if text == "python-docs":
        from kvzap_export.texts import held_out_texts

        try:
            return held_out_texts(count)
        except ValueError as exc:
            raise ConfigError(f"--prompts {count}: {exc}") from None
    from kvzap_export.train.data import domain_prompts
    from kvzap_export.train.sources import domain_sources

    docs = [source.load() for source in domain_sources(text)]
    return [p.text for p in domain_prompts(tokenizer, text, docs, count, seed, test=True)]


def evaluate_quality(model: str = "smollm2-135m", variant: str = "mlp", weights: str | None = None, thresholds=None,
                     prompts: int = 4, prompt_tokens: int = 600, new_tokens: int = 64, seed: int = 0, progress=None,
                     text: str = "legal") -> dict:
    from kvzap_export.evaluate.masked import layer_masks, prune_bias
    from kvzap_export.llm import capture_hidden_states, load_llm
    from kvzap_export.ops import threshold_compaction
    from kvzap_export.presets import load_preset
    from kvzap_export.surrogate import load_surrogate, resolve_weights
    preset = load_preset(model)
    window = preset.pruning.window
    surrogate = load_surrogate(resolve_weights(preset, variant, weights), preset)
    llm, tokenizer = load_llm(model, attn_implementation="eager")
    heads = llm.config.num_attention_heads
    texts = evaluation_texts(text, prompts, tokenizer, seed)
    if len(texts) < prompts:
        raise ConfigError(f"--prompts {prompts}: the {text} text holds only {len(texts)} prompts; ask for fewer")
    gen = torch.Generator().manual_seed(seed)
    rows: dict[tuple[float, str], list[tuple[float, float, float]]] = {}
    full_nll = []
    advance = progress("evaluate prompts", len(texts)) if progress else None
    chosen_thresholds = None
    for document in texts:
        ids = tokenizer(document, return_tensors="pt").input_ids[:, : prompt_tokens + new_tokens]
        prompt_len = ids.shape[1] - new_tokens
        with capture_hidden_states(llm) as hidden, torch.no_grad():
            full_logits = llm(input_ids=ids).logits
        full_nll.append(torch.nn.functional.cross_entropy(full_logits[0, prompt_len - 1:-1].float(), ids[0, prompt_len:]).item())
        with torch.no_grad():
            scores = [surrogate.score(l, hidden[l][0, :prompt_len]).T for l in range(preset.num_layers)]  # (H_kv, T_p)
        if chosen_thresholds is None:
            evictable = torch.cat([s[:, : prompt_len - window].ravel() for s in scores])
            chosen_thresholds = list(thresholds) if thresholds else [float(evictable.quantile(q)) for q in DEFAULT_QUANTILES]
        lengths = torch.tensor([prompt_len])
        for tau in chosen_thresholds:
            kv_pruned = [~threshold_compaction(s[None], lengths, tau, window).keep[0] for s in scores]
            per_method = {
                "kvzap": kv_pruned,
                "random": [torch.cat([_baseline("random", p.sum(1), prompt_len - window, gen),
                                      torch.zeros(p.shape[0], window, dtype=torch.bool)], 1) for p in kv_pruned],
                "recent": [torch.cat([_baseline("recent", p.sum(1), prompt_len - window, gen),
                                      torch.zeros(p.shape[0], window, dtype=torch.bool)], 1) for p in kv_pruned],
            }
            compression = float(torch.stack([p.float().mean() for p in kv_pruned]).mean())
            for method, pruned in per_method.items():
                biases = {l: prune_bias(p, prompt_len, ids.shape[1], heads) for l, p in enumerate(pruned)}
                with layer_masks(llm, biases), torch.no_grad():
                    logits = llm(input_ids=ids).logits
                agree, nll = _quality(logits, full_logits, ids, prompt_len)
                rows.setdefault((tau, method), []).append((compression, agree, nll))
        if advance:
            advance()
    results = []
    for (tau, method), values in rows.items():
        n = len(values)
        results.append({"threshold": tau, "method": method, "compression": sum(v[0] for v in values) / n,
                        "next_token_agreement": sum(v[1] for v in values) / n,
                        "perplexity": math.exp(sum(v[2] for v in values) / n)})
    return {"model": preset.name, "variant": variant, "text": text, "text_kind": TEXTS[text], "prompts": len(texts),
            "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens, "window": window, "full_cache_perplexity": math.exp(sum(full_nll) / len(full_nll)),
            "results": sorted(results, key=lambda r: (r["threshold"], METHODS.index(r["method"])))}


def at_half_compression(report: dict) -> dict:
    """The threshold whose KVzap compression is closest to 50%, with each method's quality there."""
    kv = [r for r in report["results"] if r["method"] == "kvzap"]
    best = min(kv, key=lambda r: abs(r["compression"] - 0.5))
    return {r["method"]: r for r in report["results"] if r["threshold"] == best["threshold"]}


def write_evaluation(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    half = at_half_compression(report)
    report = {**report, "at_half_compression": half}
    (out / "evaluate.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# Does pruning hurt? {report['model']} ({report['variant']} surrogate)", "",
             f"{report['prompts']} prompts of {report['prompt_tokens']} tokens of {report.get('text_kind', 'held-out text')}, {report['new_tokens']}-token continuations "
             f"teacher-forced; window {report['window']}. Full-cache perplexity {report['full_cache_perplexity']:.2f}.", "",
             "| τ | method | compression | next-token agreement | perplexity |", "|---|---|---|---|---|"]
    for r in report["results"]:
        lines.append(f"| {r['threshold']:.3f} | {r['method']} | {r['compression']:.1%} | {r['next_token_agreement']:.3f} | {r['perplexity']:.2f} |")
    k = half["kvzap"]
    lines += ["", f"At ≈50% compression (τ = {k['threshold']:.3f}, {k['compression']:.1%} pruned): next-token agreement "
              + ", ".join(f"{m} {half[m]['next_token_agreement']:.3f}" for m in METHODS)
              + "; perplexity " + ", ".join(f"{m} {half[m]['perplexity']:.2f}" for m in METHODS) + ".", ""]
    (out / "evaluate.md").write_text("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for method in METHODS:
            pts = sorted((r["compression"], r["next_token_agreement"], r["perplexity"]) for r in report["results"] if r["method"] == method)
            axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
            axes[1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=method)
        axes[0].set_ylabel("next-token agreement with full cache")
        axes[1].set_ylabel("continuation perplexity")
        axes[1].axhline(report["full_cache_perplexity"], color="k", ls="--", lw=0.8, label="full cache")
        for ax in axes:
            ax.set_xlabel("fraction of prompt KV cache pruned")
            ax.legend()
        fig.suptitle(f"{report['model']}: KVzap vs baselines at equal compression")
        fig.tight_layout()
        fig.savefig(out / "quality_vs_compression.png", dpi=110)
        plt.close(fig)
    except ModuleNotFoundError:
        pass
