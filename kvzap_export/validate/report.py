"""Writes ``BUNDLE/report/``: parity.json, parity.md (a ✓/✗ checklist), plots and Polygraphy files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

REPORT_DIR = "report"
_MARK = {"passed": "✓", "failed": "✗", "skipped": "–"}


def _headline(check: dict) -> str:
    d = check["detail"]
    if check["status"] == "skipped":
        return f"did not run: {d.get('reason', '')}"
    if "unexplained_flips" in d:
        return (f"{d.get('backend', 'onnxrt')} in {d.get('dtype', 'float32')} on {d.get('hidden_states', 'real')} hidden states "
                f"({d.get('sequences', 1)} sequences, {d.get('tokens', '?')} tokens per layer): {d['flips']} flips of "
                f"{d.get('decisions_outside_window', d['decisions'])} decisions that can flip (outside the window; "
                f"{d['decisions']} in all), {d['unexplained_flips']} unexplained, {d.get('explained_flips', 0)} within the "
                f"tolerance {d['tolerance']:.2g} of τ = {d['threshold']:g} (allowed {d.get('explained_flip_budget', 0)}); "
                f"pruned {d['pruned_fraction']:.1%}")
    if "bound" in d:
        used = ", ".join(f"{k} {v:.2g}" for k, v in d.get("bound_used", {}).items())
        return (f"{', '.join(d.get('backends', []))} vs the PyTorch reference: max abs {d['max_abs_error']:.2e}, max rel "
                f"{d['max_rel_error']:.2e}; each vs the exact scores within the bound ({d['bound']['model']}; "
                f"{d['bound']['bound_min']:.2g}–{d['bound']['bound_max']:.2g} here), largest share of it used: {used}") + \
            (f"; failed {d['failed']}" if d.get("failed") else "")
    if "max_abs_error" in d:
        return f"{', '.join(d.get('backends', []))}: max abs {d['max_abs_error']:.2e}, max rel {d['max_rel_error']:.2e}" + \
            (f"; failed {d['failed']}" if d.get("failed") else "")
    if "mismatches" in d:
        return (f"{d.get('backend', 'onnxrt')}: exact comparison with the reference, {d['mismatches']} mismatching "
                f"elements over shapes {d.get('shapes')}")
    if "problems" in d:
        return "; ".join(d["problems"]) or (f"manifest.json as written: sections match their digests, "
                                            f"{d.get('files_rehashed', 0)} files re-hashed, ONNX graphs checked")
    return d.get("summary", d.get("reason", ""))


VERDICT_LINE = {"passed": "PASSED (every check ran and passed)", "failed": "FAILED",
                "incomplete": "INCOMPLETE (nothing failed, but not every check ran)"}


def _device_line(device: dict) -> str:
    if not isinstance(device, dict):
        return f"device {device}"
    parts = [f"device {device.get('kind', 'cpu')}"]
    for key in ("gpu", "compute_capability", "driver", "cuda", "torch"):
        if device.get(key):
            parts.append(f"{key} {device[key]}")
    if device.get("onnxruntime_note"):
        parts.append(device["onnxruntime_note"])
    return ", ".join(parts)


def _layers_line(layers: list[dict]) -> str:
    """One line for every surrogate layer's operator check: ✓ only when each layer ran and passed; a mix of
    passed and not run is shown as not run, naming the layers that did not run and why."""
    failed = [c for c in layers if c["status"] == "failed"]
    skipped = [c for c in layers if c["status"] == "skipped"]
    ran = [c for c in layers if c["status"] != "skipped"]
    status = "failed" if failed else "skipped" if skipped else "passed"
    line = f"- {_MARK[status]} surrogate layers ({len(layers)}) vs PyTorch"
    if ran:
        worst = max(c["detail"].get("max_abs_error", 0.0) for c in ran)
        source = ran[0]["detail"].get("hidden_states")
        line += (f": {len(ran)} ran, max abs error {worst:.2e}"
                 + (f" (random and {source} hidden states)" if source and source != "random only" else ""))
        bounds = [c["detail"] for c in ran if "bound" in c["detail"]]
        if bounds:
            used = max((v for d in bounds for v in d.get("bound_used", {}).values()), default=0.0)
            line += (f"; each computation vs the exact scores, bound: {bounds[0]['bound']['model']}; largest share "
                     f"of the bound used {used:.2g} (above 1: outside)")
    if failed:
        line += f"; failed: {', '.join(c['name'] for c in failed)}"
    if skipped:
        reasons = sorted({c["detail"].get("reason", "") for c in skipped})
        line += f"; did not run: {_layer_names(skipped)} ({'; '.join(reasons)})"
    return line


def _layer_names(layers: list[dict]) -> str:
    if len(layers) > 6:
        return f"{len(layers)} layers ({layers[0]['name']} … {layers[-1]['name']})"
    return ", ".join(c["name"] for c in layers)


def _markdown(report: dict) -> str:
    state = report.get("verdict", "passed" if report.get("passed") else "failed")
    lines = [f"# Parity report: {VERDICT_LINE[state]}", ""]
    if report.get("failed"):
        lines += [f"Failed: {', '.join(report['failed'])}.", ""]
    if report.get("not_run"):
        lines += ["Did not run:", ""] + [f"- {n['check']}: {n['reason']}" for n in report["not_run"]] + [""]
    if report.get("not_written"):
        lines += ["Optional parts not written:", ""] + [f"- `{n['part']}`: {n['why']}" + (f" (`{n['install']}`)" if n.get("install") else "")
                                                       for n in report["not_written"]] + [""]
    lines += [f"Bundle `{report['bundle']}`, backends {', '.join(report['backends'])}, {_device_line(report['device'])}.", ""]
    levels = {}
    for check in report["checks"]:
        levels.setdefault(check["level"], []).append(check)
    for level, checks in levels.items():
        lines += [f"## {level}", ""]
        operator_layers = [c for c in checks if c["name"].startswith("operator:surrogate_layer_")]
        others = [c for c in checks if c not in operator_layers]
        if operator_layers:
            lines.append(_layers_line(operator_layers))
        for check in others:
            lines.append(f"- {_MARK[check['status']]} {check['name']}: {_headline(check)}")
        lines.append("")
    return "\n".join(lines)


def _plots(directory: Path, samples: dict, plots: dict, manifest: dict, not_written: list[dict]) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        not_written.append({"part": f"{REPORT_DIR}/scores.png, {REPORT_DIR}/compression.png",
                            "why": "plots need matplotlib, which is not installed", "install": PLOTS_INSTALL})
        return []
    written = []
    if any(sample[2] for sample in samples.values()):
        fig, ax = plt.subplots(figsize=(5, 5))
        for layer, (_feeds, refs, gots, _bound) in list(samples.items())[:: max(1, len(samples) // 6)]:
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


POLYGRAPHY_INSTALL = "pip install 'kvzap-export[polygraphy]'"
PLOTS_INSTALL = "pip install 'kvzap-export[model]'"


def _polygraphy(directory: Path, samples: dict, manifest: dict, not_written: list[dict]) -> list[str]:
    """Inputs and reference outputs of layer 0 in Polygraphy's formats, and the line that replays them."""
    part = f"{REPORT_DIR}/polygraphy/"
    try:
        from polygraphy.comparator import RunResults
        from polygraphy.comparator.struct import IterationResult
        from polygraphy.json import save_json
        from polygraphy.logger import G_LOGGER
    except ModuleNotFoundError:
        not_written.append({"part": part, "why": "Polygraphy replay files need polygraphy, which is not installed",
                            "install": POLYGRAPHY_INSTALL})
        return []
    G_LOGGER.module_severity = G_LOGGER.ERROR  # it logs to stdout, which carries --json
    if not samples:
        not_written.append({"part": part, "why": "no surrogate graph was checked"})
        return []
    if manifest["dtype"] == "bfloat16":
        not_written.append({"part": part, "why": "Polygraphy's JSON holds numpy arrays, which have no bfloat16"})
        return []
    layer = min(samples)
    feeds, refs, _gots, bound = samples[layer]
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
        f"--atol {2 * bound:.2g} --rtol 0 --check-error-stat max"  # both within the bound of the exact scores
    ]


def write_report(bundle: Path, manifest: dict, report: dict[str, Any], samples: dict, plots: dict) -> Path:
    directory = bundle / REPORT_DIR
    directory.mkdir(exist_ok=True)
    not_written: list[dict] = []
    report["plots"] = _plots(directory, samples, plots, manifest, not_written)
    report["polygraphy"] = _polygraphy(directory, samples, manifest, not_written)
    report["not_written"] = not_written
    # A part this run did not write must not survive from an earlier run beside the new report.
    if not report["polygraphy"]:
        shutil.rmtree(directory / "polygraphy", ignore_errors=True)
    for stale in {"scores.png", "compression.png"} - set(report["plots"]):
        (directory / stale).unlink(missing_ok=True)
    (directory / "parity.json").write_text(json.dumps(report, indent=2, default=float) + "\n")
    md = _markdown(report)
    if report["polygraphy"]:
        md += "\n## Reproduce the operator check on TensorRT\n\nFrom the bundle directory:\n\n```\n" + "\n".join(report["polygraphy"]) + "\n```\n"
    (directory / "parity.md").write_text(md)
    return directory
