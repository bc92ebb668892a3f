"""Training report: held-out squared Pearson correlation (R²) per layer and per head; table, plot, JSON."""

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


def write_report(out: Path, results: dict[str, torch.Tensor], meta: dict) -> dict:
    """results: variant -> R² (L, H). Writes report.md, report.json and r2.png under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    summary = {v: {"mean_r2": float(r2.mean()), "per_layer": r2.mean(1).tolist(), "per_layer_head": r2.tolist()}
               for v, r2 in results.items()}
    (out / "report.json").write_text(json.dumps({**meta, "variants": summary}, indent=2) + "\n")
    variants = list(results)
    lines = [f"# KVzap surrogate training report: {meta.get('model')}", "",
             f"Held-out squared Pearson correlation (R²) between predicted and KVzip+ log-scores, on "
             f"{meta.get('held_out_pairs')} held-out token positions (each scored at every layer and KV head) from {meta.get('held_out_prompts')} prompts never "
             f"seen in training.", "",
             "| variant | mean R² over (layer, head) |", "|---|---|"]
    lines += [f"| {v} | {summary[v]['mean_r2']:.3f} |" for v in variants]
    heads = next(iter(results.values())).shape[1]
    lines += ["", "Per layer (mean over heads; then each head):", "",
              "| layer | " + " | ".join(f"{v} mean" for v in variants) + " | " +
              " | ".join(f"{v} h{h}" for v in variants for h in range(heads)) + " |",
              "|---|" + "---|" * (len(variants) * (heads + 1))]
    for layer in range(next(iter(results.values())).shape[0]):
        cells = [f"{float(results[v][layer].mean()):.3f}" for v in variants]
        cells += [f"{float(results[v][layer, h]):.3f}" for v in variants for h in range(heads)]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    lines += ["", "Command:", "", "```", meta.get("command", ""), "```", ""]
    if meta.get("notes"):
        lines += ["Notes:", "", *[f"- {n}" for n in meta["notes"]], ""]
    (out / "report.md").write_text("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for v, r2 in results.items():
            ax.plot(r2.mean(1).numpy(), marker="o", ms=3, label=f"{v} (mean {float(r2.mean()):.2f})")
        ax.set_xlabel("layer")
        ax.set_ylabel("held-out R² (mean over KV heads)")
        ax.set_ylim(0, 1)
        ax.set_title(f"KVzap surrogate fit: {meta.get('model')}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "r2.png", dpi=110)
        plt.close(fig)
    except ModuleNotFoundError:
        pass
    return summary
