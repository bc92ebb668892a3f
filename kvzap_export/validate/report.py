"""Writes ``BUNDLE/report/``: parity.json, parity.md (a ✓/✗ checklist), plots and Polygraphy files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

REPORT_DIR = "report"
_MARK = {"passed": "✓", "failed": "✗", "skipped": "–"}


def _headline(check: dict) -> str:
    d = check["detail"]
    if check["status"] == "skipped":
        return d.get("reason", "")
    if "unexplained_flips" in d:
        return (f"{d.get('backend', 'onnxrt')} in {d.get('dtype', 'float32')}: {d['flips']} flips of {d['decisions']} "
                f"decisions, {d['unexplained_flips']} unexplained (tolerance {d['tolerance']:.2g} around "
                f"τ = {d['threshold']:g}); pruned {d['pruned_fraction']:.1%}")
    if "max_abs_error" in d:
        return f"{', '.join(d.get('backends', []))}: max abs {d['max_abs_error']:.2e}, max rel {d['max_rel_error']:.2e}" + \
            (f"; failed {d['failed']}" if d.get("failed") else "")
    if "mismatches" in d:
        return (f"{d.get('backend', 'onnxrt')}: exact comparison, {d['mismatches']} mismatching elements over shapes "
                f"{d.get('shapes')}")
    if "problems" in d:
        return "; ".join(d["problems"]) or "manifest sections match their digests"
    return d.get("summary", "")


def _markdown(report: dict) -> str:
    verdict = "PASSED" if report["passed"] else f"FAILED: {', '.join(report['failed'])}"
    lines = [f"# Parity report: {verdict}", "", f"Bundle `{report['bundle']}`, backends {', '.join(report['backends'])}, "
             f"device {report['device']}.", ""]
    levels = {}
    for check in report["checks"]:
        levels.setdefault(check["level"], []).append(check)
    for level, checks in levels.items():
        lines += [f"## {level}", ""]
        operator_layers = [c for c in checks if c["name"].startswith("operator:surrogate_layer_")]
        others = [c for c in checks if c not in operator_layers]
        if operator_layers:
            failed = [c for c in operator_layers if c["status"] == "failed"]
            status = "failed" if failed else operator_layers[0]["status"]
            worst = max((c["detail"].get("max_abs_error", 0.0) for c in operator_layers), default=0.0)
            lines.append(f"- {_MARK[status]} surrogate layers ({len(operator_layers)}): max abs error {worst:.2e}"
                         + (f"; failed: {', '.join(c['name'] for c in failed)}" if failed else "")
                         + (f" ({operator_layers[0]['detail'].get('reason')})" if status == "skipped" else ""))
        for check in others:
            lines.append(f"- {_MARK[check['status']]} {check['name']}: {_headline(check)}")
        lines.append("")
    return "\n".join(lines)


def _plots(directory: Path, samples: dict, plots: dict, manifest: dict) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        return []
    written = []
    if any(gots for _f, _r, gots in samples.values()):
        fig, ax = plt.subplots(figsize=(5, 5))
        for layer, (_feeds, refs, gots) in list(samples.items())[:: max(1, len(samples) // 6)]:
            if not gots:
                continue
            ref = np.concatenate([r["scores"].ravel() for r in refs])
            got = np.concatenate([g["scores"].ravel() for g in gots]).astype(np.float32)
            ax.scatter(ref, got, s=2, label=f"layer {layer}")
        ax.axvline(manifest["pruning"]["threshold"], color="k", lw=0.8, ls="--", label="τ")
        ax.set_xlabel("reference score (PyTorch)")
        ax.set_ylabel("exported score")
        ax.set_title("reference vs exported scores")
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(directory / "scores.png", dpi=110)
        plt.close(fig)
        written.append("scores.png")
    if "heatmap" in plots:
        fig, ax = plt.subplots(figsize=(5, 6))
        image = ax.imshow(plots["heatmap"], aspect="auto", cmap="viridis", vmin=0, vmax=1)
        ax.set_xlabel("KV head")
        ax.set_ylabel("layer")
        ax.set_title("pruned fraction per layer × head")
        fig.colorbar(image)
        fig.tight_layout()
        fig.savefig(directory / "compression.png", dpi=110)
        plt.close(fig)
        written.append("compression.png")
    return written


def _polygraphy(directory: Path, samples: dict, manifest: dict) -> list[str]:
    """Inputs and reference outputs of layer 0 in Polygraphy's formats, and the line that replays them."""
    try:
        from polygraphy.comparator import RunResults
        from polygraphy.comparator.struct import IterationResult
        from polygraphy.json import save_json
        from polygraphy.logger import G_LOGGER
    except ModuleNotFoundError:
        return []
    G_LOGGER.module_severity = G_LOGGER.ERROR  # it logs to stdout, which carries --json
    if not samples or manifest["dtype"] == "bfloat16":
        return []
    layer = min(samples)
    feeds, refs, _gots = samples[layer]
    target = directory / "polygraphy"
    target.mkdir(parents=True, exist_ok=True)
    save_json(feeds, str(target / f"layer_{layer:03d}_inputs.json"))
    results = RunResults()
    results.append(("torch-reference", [IterationResult(dict(r), runner_name="torch-reference") for r in refs]))
    results.save(str(target / f"layer_{layer:03d}_reference.json"))
    artifact = next(a for a in manifest["artifacts"] if a.get("layer") == layer and a["kind"] == "surrogate_layer")
    hidden = manifest["model"]["hidden_size"]
    max_tokens = max(len(f["hidden_states"]) for f in feeds)
    return [
        f"polygraphy run {artifact['path']} --trt --trt-min-shapes hidden_states:[1,{hidden}] "
        f"--trt-opt-shapes hidden_states:[{max_tokens},{hidden}] --trt-max-shapes hidden_states:[{max(max_tokens, 512)},{hidden}] "
        f"--load-inputs report/polygraphy/layer_{layer:03d}_inputs.json --load-outputs report/polygraphy/layer_{layer:03d}_reference.json "
        f"--atol 1e-5 --rtol 1e-5 --check-error-stat max"
    ]


def write_report(bundle: Path, manifest: dict, report: dict[str, Any], samples: dict, plots: dict) -> Path:
    directory = bundle / REPORT_DIR
    directory.mkdir(exist_ok=True)
    report["plots"] = _plots(directory, samples, plots, manifest)
    report["polygraphy"] = _polygraphy(directory, samples, manifest)
    (directory / "parity.json").write_text(json.dumps(report, indent=2, default=float) + "\n")
    md = _markdown(report)
    if report["polygraphy"]:
        md += "\n## Reproduce the operator check on TensorRT\n\nFrom the bundle directory:\n\n```\n" + "\n".join(report["polygraphy"]) + "\n```\n"
    (directory / "parity.md").write_text(md)
    return directory
