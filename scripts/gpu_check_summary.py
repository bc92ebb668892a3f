#!/usr/bin/env python
"""Summary of a ``scripts/gpu_check.sh`` run: reads what its steps left in OUTDIR, writes ``gpu-check.json`` and
``gpu-check.md`` there (every figure with the device name), prints the markdown, and exits 0 when every check that
ran passed, 1 when one failed, 3 when nothing failed but a step did not run.

    python scripts/gpu_check_summary.py OUTDIR

Checks (correctness): each step's exit status (validate: 0 or 3, "incomplete", is a pass of what ran), the GPU tests
(JUnit XML), compute-sanitizer's error summary, every validate report's verdict, the ragged benchmark's exactness
checks. Targets (performance, reported met / missed, they do not set the exit status): the CUDA and Triton fused
compaction >= 5x the torch reference at 128k tokens; scoring + per-step decision <= 5% of one attention block at
decode (32k cache, CUDA graphs) and scoring + compaction <= 2% at 32k prefill (MLP surrogate); the ragged
benchmark's own targets.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ACCEPTED_RC = {"validate": {0, 3}}  # validate: 3 = incomplete (nothing failed, e.g. no model on this machine)
EXPECTED_NOT_RUN = {"model", "engine"}  # levels that need the model or an engine, which do not travel to a GPU machine
PREFILL_LIMIT_PCT, DECODE_LIMIT_PCT, COMPACTION_SPEEDUP = 2.0, 5.0, 5.0


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _steps(out: Path) -> list[dict]:
    steps = []
    for line in (out / "steps.tsv").read_text().splitlines() if (out / "steps.tsv").is_file() else []:
        name, rc, seconds, cut = (line.split("\t") + ["0"])[:4]
        steps.append({"step": name, "rc": rc, "seconds": int(seconds), "cut_by_budget": cut == "1"})
    return steps


def _step_check(step: dict, out: Path) -> dict:
    accepted = ACCEPTED_RC.get(step["step"].split("_")[0], {0})
    if step["rc"] in ("skipped", "missing"):
        log = out / f"{step['step']}.log"
        why = "the time budget was spent" if step["rc"] == "skipped" else \
            (log.read_text().strip() if log.is_file() else "not on this machine")
        return {"check": f"step:{step['step']}", "status": "not run", "detail": why}
    rc = int(step["rc"])
    if rc in (124, 137) and step["cut_by_budget"]:  # stopped by the overall budget, not by its own limit
        return {"check": f"step:{step['step']}", "status": "not run",
                "detail": f"stopped after {step['seconds']} s: the check's time budget ran out"}
    detail = f"exit {rc} in {step['seconds']} s" + (" (its time limit)" if rc in (124, 137) else "")
    return {"check": f"step:{step['step']}", "status": "passed" if rc in accepted else "failed", "detail": detail}


def _pytest(out: Path) -> list[dict]:
    return _junit(out / "pytest-gpu.xml", "pytest -m gpu") + _junit(out / "pytest-kernels.xml", "kernel tests on the GPU")


def _junit(path: Path, name: str) -> list[dict]:
    if not path.is_file():
        return []
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    skipped = sorted({(c.find("skipped").get("message") or "")[:120] for c in suite.iter("testcase") if c.find("skipped") is not None})
    failed = [f"{c.get('classname')}.{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    # on a GPU machine a test that skipped for want of a GPU or nvcc did not check what it is for
    no_gpu = [r for r in skipped if "CUDA GPU" in r or "nvcc" in r]
    status = "failed" if failed or passed == 0 else "not run" if no_gpu else "passed"
    return [{"check": name, "status": status,
             "detail": f"{passed} passed, {n['failures'] + n['errors']} failed, {n['skipped']} skipped"
                       + (f"; skipped for want of a GPU or nvcc: {no_gpu}" if no_gpu else ""),
             "failed": failed, "skip_reasons": skipped}]


def _sanitizer(out: Path) -> list[dict]:
    log = out / "sanitizer_memcheck.log"
    if not log.is_file():
        return []
    text = log.read_text(errors="replace")
    found = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    exact = "exactly equal the reference" in text
    ok = bool(found) and all(n == "0" for n in found) and exact
    return [{"check": "compute-sanitizer memcheck (bench_kernels --check)", "status": "passed" if ok else "failed",
             "detail": f"error summaries {found or 'absent'}; kernels {'exact' if exact else 'NOT shown exact'}"}]


def _validates(out: Path) -> list[dict]:
    bundles = dict(line.split("\t") for line in (out / "bundles.tsv").read_text().splitlines()) \
        if (out / "bundles.tsv").is_file() else {}
    checks = []
    for name, bundle in bundles.items():
        report = _json(out / f"{name}.json")
        if report is None:
            checks.append({"check": f"validate --device cuda {bundle}", "status": "failed", "detail": "no report"})
            continue
        layers = [c for c in report["checks"] if c["name"].startswith("operator:surrogate_layer_") and c["status"] != "skipped"]
        used = max((v for c in layers for v in c["detail"].get("bound_used", {}).values()), default=None)
        # incomplete is a pass of what ran only where what did not run needs the model (it cannot travel here)
        elsewhere = [n["check"] for n in report.get("not_run", []) if n.get("level") not in EXPECTED_NOT_RUN]
        status = "failed" if report["verdict"] == "failed" else "not run" if elsewhere else "passed"
        scope = " (what ran: the model level needs the model, which does not travel here)" if report.get("not_run") else ""
        checks.append({"check": f"validate --device cuda {bundle}{scope}", "status": status,
                       "detail": f"verdict {report['verdict']}; {sum(c['status'] == 'passed' for c in report['checks'])} "
                                 f"checks passed, failed {report['failed']}, did not run "
                                 f"{[n['check'] for n in report.get('not_run', [])]}",
                       "dtype": (_json(Path(bundle) / "manifest.json") or {}).get("dtype"),
                       "surrogate_bound_used_max": used, "device": report.get("device")})
    return checks


def _kernel_figures(data: dict | None, device: str) -> tuple[list[dict], list[dict]]:
    if not data:
        return [], []
    figures = [{"device": device, "source": "bench_kernels.py", **row} for row in data["rows"]]
    targets = []
    longest = max((r["seq"] for r in data["rows"]), default=0)
    for impl in sorted({r["impl"] for r in data["rows"]}):
        best = max((r["speedup"] for r in data["rows"] if r["impl"] == impl and r["benchmark"] == "compaction"
                    and r["seq"] == longest), default=None)
        if best is not None:
            targets.append({"target": f"{impl} fused compaction vs torch reference at {longest} tokens", "value": best,
                            "limit": f">= {COMPACTION_SPEEDUP}x", "met": best >= COMPACTION_SPEEDUP, "device": device})
    return figures, targets


def _bench_figures(data: dict | None, device: str) -> tuple[list[dict], list[dict]]:
    if not data:
        return [], []
    figures = [{"source": f"bench {suite}", **row, "device": f"the host CPU of {device}" if row.get("device") == "cpu" else device}
               for suite, rows in data["results"].items() for row in rows]
    targets = []
    for row in data["results"].get("overhead", []):
        if row.get("variant") != "mlp" or "skipped" in row:
            continue
        if row["phase"] == "decode" and "overhead_graphed_time_pct" in row:
            value = row["overhead_graphed_time_pct"]
            targets.append({"target": f"decode at {row['kv_len']}: MLP scoring + decision / attention block (CUDA graphs)",
                            "value": value, "limit": f"<= {DECODE_LIMIT_PCT}%", "met": value <= DECODE_LIMIT_PCT, "device": device})
        if row["phase"] == "prefill" and row["q_len"] >= 32768 and "overhead_time_pct" in row:
            value = row["overhead_time_pct"]
            targets.append({"target": f"prefill {row['q_len']}: MLP scoring + {row['compaction']} / attention block",
                            "value": value, "limit": f"<= {PREFILL_LIMIT_PCT}%", "met": value <= PREFILL_LIMIT_PCT, "device": device})
    return figures, targets


def _ragged(data: dict | None, device: str) -> tuple[list[dict], list[dict], list[dict]]:
    """scripts/bench_ragged_decode.py's report: its rows (exactness, attention, layer step, the step's parts, replay),
    its exactness and replay checks, its sections that raised (failures), its targets."""
    if not data:
        return [], [], []
    replay = [data["replay"]] if data.get("replay") else []
    figures = [{"source": f"bench_ragged_decode.py {section}", **row, "device": row.get("device", device)}
               for section in ("exactness", "attention", "layer", "parts") for row in data.get(section, [])]
    figures += [{"source": "bench_ragged_decode.py replay", **row, "device": row.get("device", device)} for row in replay]
    checks = [{"check": f"ragged exactness: {r.get('kernel')} vs the float32 formula",
               "status": "passed" if r.get("passed") else "failed",
               "detail": f"max abs error {r.get('max_abs_err')}"} for r in data.get("exactness", [])]
    checks += [{"check": "ragged layer step: CUDA graph replay vs eager, 50 steps", "status": "passed" if r.get("passed") else "failed",
                "detail": {k: r.get(k) for k in ("bookkeeping_equal", "max_abs_diff_attention", "max_abs_diff_layer",
                                                  "stores_max_abs_diff", "evicted_fraction")}} for r in replay]
    checks += [{"check": f"ragged section {e.get('section')}", "status": "failed", "detail": e.get("error")}
               for e in data.get("errors", [])]
    targets = [{"target": t.get("name"), "value": t.get("value"), "limit": f"<= {t.get('limit')}",
                "met": bool(t.get("passed")), "device": t.get("device", device)} for t in data.get("targets", [])]
    return figures, checks, targets


def summarize(out: Path) -> tuple[dict, int]:
    kernels, bench, ragged = _json(out / "bench-kernels.json"), _json(out / "bench-cuda.json"), _json(out / "ragged-decode.json")
    device = next((d for d in ((kernels or {}).get("meta", {}).get("device"), (bench or {}).get("machine"),
                               (ragged or {}).get("device")) if d), _gpu_name())
    checks = [_step_check(s, out) for s in _steps(out)] + _pytest(out) + _sanitizer(out) + _validates(out)
    figures, targets = _kernel_figures(kernels, device)
    more_figures, more_targets = _bench_figures(bench, device)
    ragged_figures, ragged_checks, ragged_targets = _ragged(ragged, device)
    checks += ragged_checks
    figures += more_figures + ragged_figures
    targets += more_targets + ragged_targets
    failed = [c["check"] for c in checks if c["status"] == "failed"]
    not_run = [c["check"] for c in checks if c["status"] == "not run"]
    verdict = "failed" if failed else "incomplete" if not_run else "passed"
    summary = {"schema": "kvzap-export-gpu-check/1", "device": device, "date": datetime.date.today().isoformat(),
               "commit": _commit(), "verdict": verdict, "failed": failed, "not_run": not_run, "checks": checks,
               "targets": targets, "figures": figures}
    return summary, {"passed": 0, "failed": 1, "incomplete": 3}[verdict]


def _gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    except ModuleNotFoundError:
        return "unknown"


def _commit() -> str | None:
    """The checkout's commit ($GPU_CHECK_COMMIT when set: a copied tree whose git metadata is not its own)."""
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parents[1])
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    return done.stdout.strip() + ("+uncommitted changes" if dirty else "")


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def markdown(summary: dict) -> str:
    lines = [f"# GPU check: {summary['verdict'].upper()}", "",
             f"{summary['device']} · {summary['date']} · commit {summary['commit']}", "", "## Checks", ""]
    mark = {"passed": "✓", "failed": "✗", "not run": "–"}
    lines += [f"- {mark[c['status']]} {c['check']}: {c['detail']}" for c in summary["checks"]]
    lines += ["", "## Targets (performance; reported, not gating)", ""]
    lines += [f"- {'met' if t['met'] else 'MISSED'}: {t['target']}: {_fmt(t['value'])} (limit {t['limit']}; {t['device']})"
              for t in summary["targets"]]
    lines += ["", "## Figures", "", f"Measured on {summary['device']} unless a row's device says otherwise (ONNX Runtime "
              "and the CPU torch reference run on the host CPU); the JSON holds them all with the device on each row.", ""]
    by_source: dict[str, list[dict]] = {}
    for row in summary["figures"]:
        by_source.setdefault(row["source"], []).append(row)
    for source, rows in by_source.items():
        devices = {r["device"] for r in rows}
        hidden = ("source", "benchmark") + (("device",) if len(devices) == 1 else ())
        keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in hidden]
        lines += [f"### {source}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(_fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python scripts/gpu_check_summary.py OUTDIR   (the folder scripts/gpu_check.sh wrote)", file=sys.stderr)
        return 2
    out = Path(argv[0])
    summary, code = summarize(out)
    (out / "gpu-check.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    text = markdown(summary)
    (out / "gpu-check.md").write_text(text)
    print(text)
    return code


if __name__ == "__main__":
    sys.exit(main())
