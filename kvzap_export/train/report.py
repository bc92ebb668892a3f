"""Training report: squared Pearson correlation (R²) per layer and KV head, per domain; tables, plots, JSON.

Domains: each training domain's evaluation prompts (never trained on), the same pooled ("in-domain"),
and the held-out domains, whose text of no kind was trained on.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def r2_per_head(pred: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
    """Squared Pearson correlation over tokens. pred, true: (N, L, H) -> (L, H)."""
    p = pred.double() - pred.double().mean(0)
    t = true.double() - true.double().mean(0)
    corr = (p * t).sum(0) / (p.norm(dim=0) * t.norm(dim=0)).clamp_min(1e-300)
    return (corr**2).float()


def predict(surrogate, features: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([surrogate.score(layer, features[:, layer].float()) for layer in range(features.shape[1])], dim=1)


def summarize(results: dict[str, dict[str, torch.Tensor]]) -> dict:
    """variant -> domain -> {mean_r2, worst_layer, worst_layer_r2, per_layer, per_layer_head}."""
    out = {}
    for variant, domains in results.items():
        out[variant] = {}
        for domain, r2 in domains.items():
            per_layer = r2.mean(1)
            out[variant][domain] = {"mean_r2": float(r2.mean()), "worst_layer": int(per_layer.argmin()),
                                    "worst_layer_r2": float(per_layer.min()), "per_layer": per_layer.tolist(),
                                    "per_layer_head": r2.tolist()}
    return out


def _order(meta: dict, domains) -> list[str]:
    held = set(meta.get("held_out_domains", []))
    return sorted(domains, key=lambda d: (d in held, d != "in-domain", d))


def _markdown(summary: dict, meta: dict) -> list[str]:
    variants = list(summary)
    domains = _order(meta, next(iter(summary.values())))
    held = set(meta.get("held_out_domains", []))
    pairs = meta.get("evaluation_pairs", {})
    lines = [f"# KVzap surrogate training report: {meta.get('model')}", "",
             f"Squared Pearson correlation (R²) between predicted and KVzip+ log-scores, per (layer, KV head), on text "
             f"never trained on: each training domain's evaluation prompts (1 in 8, pooled as *in-domain*) and the "
             f"held-out domains ({', '.join(sorted(held)) or 'none'}), whose kind of text was never trained on. "
             f"Trained on {meta.get('train_pairs')} (position, layer-stack) pairs.", "",
             "| domain | role | evaluation positions | " + " | ".join(f"{v} mean R² | {v} worst layer" for v in variants) + " |",
             "|---|---|---|" + "---|---|" * len(variants)]
    for d in domains:
        role = "held out" if d in held else ("pooled" if d == "in-domain" else "in-domain")
        cells = [f"{summary[v][d]['mean_r2']:.3f} | {summary[v][d]['worst_layer_r2']:.3f} (layer {summary[v][d]['worst_layer']})"
                 for v in variants]
        lines.append(f"| {d} | {role} | {pairs.get(d, '')} | " + " | ".join(cells) + " |")
    for v in variants:
        lines += ["", f"## {v}: R² per layer (mean over KV heads)", "",
                  "| layer | " + " | ".join(domains) + " |", "|---|" + "---|" * len(domains)]
        for layer in range(len(summary[v][domains[0]]["per_layer"])):
            lines.append(f"| {layer} | " + " | ".join(f"{summary[v][d]['per_layer'][layer]:.3f}" for d in domains) + " |")
        heads = len(summary[v][domains[0]]["per_layer_head"][0])
        lines += ["", f"## {v}: R² per layer and KV head", "",
                  "| layer | " + " | ".join(f"{d} h{h}" for d in domains for h in range(heads)) + " |",
                  "|---|" + "---|" * (len(domains) * heads)]
        for layer in range(len(summary[v][domains[0]]["per_layer"])):
            lines.append(f"| {layer} | " + " | ".join(f"{summary[v][d]['per_layer_head'][layer][h]:.3f}"
                                                      for d in domains for h in range(heads)) + " |")
    lines += ["", "## Corpus", "", "| domain | training prompts | evaluation prompts | what |", "|---|---|---|---|"]
    for d, c in sorted(meta.get("prompts_per_domain", {}).items()):
        lines.append(f"| {d} | {c['train']} | {c['evaluation']} | {meta.get('domains', {}).get(d, '')} |")
    if meta.get("sources"):
        lines += ["", "| source | domain | title | licence | installed by |", "|---|---|---|---|---|"]
        lines += [f"| {s['name']} | {s['domain']} | {s['title']} | {s['licence']} | {s['provider']} |" for s in meta["sources"]]
    if meta.get("data"):
        lines += ["", f"Training text: the user's data ({', '.join(meta['data'])})."]
    if meta.get("mlp_hidden_dim"):
        decays = meta.get("weight_decay") or []
        decay = (f"AdamW weight decay chosen per layer from {', '.join(f'{d:g}' for d in decays)} by validation R²"
                 if len(decays) > 1 else f"AdamW weight decay {decays[0]:g}" if decays else "")
        lines += ["", f"MLP: hidden width {meta['mlp_hidden_dim']}, {meta.get('epochs')} epochs, {decay}, targets standardized "
                  f"per KV head while fitting (folded back into the output layer)."]
    lines += ["", f"Target collection {meta.get('target_collection_s')} s, fits {meta.get('fit_s')} s, in all "
              f"{meta.get('total_s')} s. Command:", "", "```", meta.get("command", ""), "```", ""]
    if meta.get("notes"):
        lines += ["Notes:", "", *[f"- {n}" for n in meta["notes"]], ""]
    return lines


def _plot(out: Path, summary: dict, meta: dict) -> None:
    try:
        import matplotlib
    except ModuleNotFoundError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    held = set(meta.get("held_out_domains", []))
    fig, axes = plt.subplots(1, len(summary), figsize=(6.5 * len(summary), 4.2), squeeze=False, sharey=True)
    for ax, (variant, domains) in zip(axes[0], summary.items(), strict=True):
        for d in _order(meta, domains):
            r = domains[d]
            style = "--" if d in held else ("-" if d == "in-domain" else ":")
            ax.plot(r["per_layer"], style, marker="o", ms=2.5, lw=2 if d == "in-domain" or d in held else 1,
                    label=f"{d}{' (held out)' if d in held else ''}: {r['mean_r2']:.2f}")
        ax.set_title(f"{meta.get('model')}: {variant} surrogate")
        ax.set_xlabel("layer")
        ax.set_ylim(0, 1)
        ax.axhline(0.6, color="grey", lw=0.5)
        ax.legend(fontsize=7, loc="lower right")
    axes[0][0].set_ylabel("R² (mean over KV heads)")
    fig.tight_layout()
    fig.savefig(out / "r2.png", dpi=110)
    plt.close(fig)


def write_report(out: Path, results: dict[str, dict[str, torch.Tensor]], meta: dict) -> dict:
    """results: variant -> domain -> R² (L, H). Writes report.md, report.json and r2.png under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(results)
    (out / "report.json").write_text(json.dumps({**meta, "variants": summary}, indent=2) + "\n")
    (out / "report.md").write_text("\n".join(_markdown(summary, meta)))
    _plot(out, summary, meta)
    return {v: {d: s["mean_r2"] for d, s in domains.items()} for v, domains in summary.items()}
