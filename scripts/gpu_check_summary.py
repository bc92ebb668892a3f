#!/usr/bin/env python
"""Summary of a ``scripts/gpu_check.sh`` run: reads what its steps left in OUTDIR, writes ``gpu-check.json`` and
``gpu-check.md`` there (every figure with the device name), prints the markdown, and exits 0 (PASSED) only when
every check ran and passed, 1 (FAILED) when one failed, 3 (INCOMPLETE) when nothing failed but something did not
run, for any reason.

    python scripts/gpu_check_summary.py OUTDIR

Checks (correctness): each step's exit status (0 passes; validate's 3, "incomplete", is not run); the GPU tests
(JUnit XML); compute-sanitizer's error summary; every validate report's verdict; the ragged benchmark's exactness
and replay checks; the SGLang engine's parity per model and mode and its CUDA graph replays (gpu_check_engine.py). Not run, each listed with why at the top of the markdown and never shown ✓: a step skipped,
missing on this machine, stopped by the overall budget, or absent from steps.tsv (every step gpu_check.sh always
runs is expected, and validate on each BUNDLE); a step's output file absent; a test skipped for any reason (a
check with a failed test stays failed); what a validate report did not run (its checks that ran get their own ✓
line); no BUNDLE given; bench rows or suites skipped; bench_kernels without the CUDA kernels; the ragged
benchmark's sections without rows, its rows skipped past its budget, a partial report; a target not measured.
Targets (performance, reported met / missed, which does not set the exit status): the CUDA and Triton fused
compaction >= 5x the torch reference at 128k tokens; scoring + per-step decision <= 5% of one attention block at
decode (32k cache, CUDA graphs) and scoring + compaction <= 2% at 32k prefill (MLP surrogate); the ragged
benchmark's own targets; SGLang's ragged mode vs dense at Llama-3.1-8B's shapes (gpu_check_engine.py).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from gpu_check_engine import ENGINE_STEPS, engine_device, engine_parts

# what gpu_check.sh always runs or records as missing (plus validate_<i> for each BUNDLE in bundles.tsv)
STEPS = ("build_cuda_library", "bench_ragged_decode", "pytest_kernels", "pytest_gpu", "sanitizer_memcheck",
         "bench_kernels", "bench_cuda", *ENGINE_STEPS)
NOT_STARTED = ("skipped", "missing", "absent")  # steps.tsv rc of a step that never started
BENCH_SUITES = ("scoring", "compaction", "overhead", "e2e")  # bench --only in gpu_check.sh
RAGGED_SECTIONS = ("exactness", "attention", "layer", "replay", "parts")  # bench_ragged_decode.py's default --only
KERNEL_IMPLS, KERNEL_SEQ = ("cuda", "triton"), 131072  # bench_kernels.py's kernels and its longest default --seq
PREFILL_LIMIT_PCT, DECODE_LIMIT_PCT, COMPACTION_SPEEDUP = 2.0, 5.0, 5.0


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _not_run(check: str, detail) -> dict:
    return {"check": check, "status": "not run", "detail": detail}


def _steps(out: Path, bundles: dict) -> list[dict]:
    """steps.tsv's rows, then every step gpu_check.sh always runs that it does not hold (rc "absent")."""
    steps = []
    for line in (out / "steps.tsv").read_text().splitlines() if (out / "steps.tsv").is_file() else []:
        name, rc, seconds, cut = (line.split("\t") + ["0", "0"])[:4]
        steps.append({"step": name, "rc": rc, "seconds": int(seconds), "cut_by_budget": cut == "1"})
    seen = {s["step"] for s in steps}
    return steps + [{"step": name, "rc": "absent", "seconds": 0, "cut_by_budget": False}
                    for name in (*STEPS, *bundles) if name not in seen]


def _step_check(step: dict, out: Path) -> dict:
    name = f"step:{step['step']}"
    if step["rc"] in NOT_STARTED:
        log = out / f"{step['step']}.log"
        why = {"skipped": "the time budget was spent before it started",
               "absent": "not in steps.tsv: the run did not record it (stopped before it, or it did not finish)"}
        return _not_run(name, why.get(step["rc"]) or (log.read_text().strip() if log.is_file() else "not on this machine"))
    rc = int(step["rc"])
    if rc in (124, 137) and step["cut_by_budget"]:  # stopped by the overall budget, not by its own limit
        return _not_run(name, f"stopped after {step['seconds']} s: the check's time budget ran out")
    detail = f"exit {rc} in {step['seconds']} s" + (" (its time limit)" if rc in (124, 137) else "")
    if rc == 3 and step["step"].startswith(("validate", "engine_parity")):  # validate's "incomplete": not all ran
        return _not_run(name, f"{detail}: incomplete, some of its checks did not run (listed below)")
    return {"check": name, "status": "passed" if rc == 0 else "failed", "detail": detail}


def _absent(check: str, path: Path, step: dict) -> list[dict]:
    """A check whose output file is absent: not run, unless its step never started (the step's own line lists it)."""
    return [] if step["rc"] in NOT_STARTED else [_not_run(check, f"{path.name} is absent (step {step['step']}: "
                                                                  f"{step['result']['detail']})")]


def _pytest(out: Path, steps: dict) -> list[dict]:
    return _junit(out / "pytest-gpu.xml", "pytest -m gpu", steps["pytest_gpu"]) + \
        _junit(out / "pytest-kernels.xml", "kernel tests on the GPU", steps["pytest_kernels"])


def _junit(path: Path, name: str, step: dict) -> list[dict]:
    """Failed if a test failed (or none passed and none skipped); else not run if any test skipped, for any reason: a
    skip is never a pass."""
    if not path.is_file():
        return _absent(name, path, step)
    cases = list(ET.parse(path).getroot().iter("testcase"))
    failed = [f"{c.get('classname')}.{c.get('name')}" for c in cases
              if c.find("failure") is not None or c.find("error") is not None]
    skipped = [f"{c.get('classname')}.{c.get('name')}: {(c.find('skipped').get('message') or '')[:160]}"
               for c in cases if c.find("skipped") is not None]
    passed = len(cases) - len(failed) - len(skipped)
    status = "failed" if failed or passed + len(skipped) == 0 else "not run" if skipped else "passed"
    return [{"check": name, "status": status,
             "detail": f"{passed} passed, {len(failed)} failed, {len(skipped)} skipped" + (f"; skipped: {skipped}" if skipped else ""),
             "failed": failed, "skipped": skipped}]


def _sanitizer(out: Path, step: dict) -> list[dict]:
    log, name = out / "sanitizer_memcheck.log", "compute-sanitizer memcheck (bench_kernels --check)"
    if step["rc"] in NOT_STARTED:  # the log, if any, says why it did not run; the step's line lists it
        return []
    if not log.is_file():
        return _absent(name, log, step)
    text = log.read_text(errors="replace")
    found = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    compared = re.search(r"check: (.*?) (?:exactly equal the reference|: MISMATCHES found)", text)
    exact = "exactly equal the reference" in text
    status = "passed" if found and all(n == "0" for n in found) and exact else \
        "failed" if any(n != "0" for n in found) or "MISMATCHES" in text or step["result"]["status"] != "not run" else "not run"
    checks = [{"check": name, "status": status, "detail": f"error summaries {found or 'absent'}; "
               f"{compared.group(1) if compared else 'the kernels'} {'exact' if exact else 'NOT shown exact'}"}]
    if exact and "CUDA library not loaded" in text:
        checks.append(_not_run("compute-sanitizer memcheck: the CUDA kernels", "the CUDA library was not loaded: "
                               "bench_kernels --check compared the Triton kernels only"))
    return checks


def _validates(out: Path, bundles: dict, steps: dict) -> list[dict]:
    """Per bundle: failed if its verdict is failed; else a passed line for the checks that ran (if any) and, where
    the verdict is not passed, a not-run line naming every check that did not run and why."""
    if not bundles:
        return [_not_run("validate --device cuda", "no BUNDLE was given (bash scripts/gpu_check.sh OUTDIR BUNDLE ...)")]
    checks = []
    for name, bundle in bundles.items():
        label, report = f"validate --device cuda {bundle}", _json(out / f"{name}.json")
        if report is None:
            step = steps[name]
            if step["rc"] not in NOT_STARTED:
                checks.append({"check": label, "status": "not run" if step["result"]["status"] == "not run" else "failed",
                               "detail": f"no report (step {name}: {step['result']['detail']})"})
            continue
        layers = [c for c in report["checks"] if c["name"].startswith("operator:surrogate_layer_") and c["status"] != "skipped"]
        used = max((v for c in layers for v in c["detail"].get("bound_used", {}).values()), default=None)
        ran = sum(c["status"] == "passed" for c in report["checks"])
        missing = [f"{n['check']} ({n.get('level')}): {n.get('reason', '')}" for n in report.get("not_run", [])]
        extra = {"dtype": (_json(Path(bundle) / "manifest.json") or {}).get("dtype"), "surrogate_bound_used_max": used,
                 "device": report.get("device")}
        if report["verdict"] == "failed":
            checks.append({"check": label, "status": "failed", "detail": f"verdict failed: {report['failed']}; "
                           f"{ran} checks passed; did not run {missing}", **extra})
            continue
        if ran:
            checks.append({"check": label, "status": "passed", "detail": f"verdict {report['verdict']}; the {ran} "
                           "checks that ran passed", **extra})
        if report["verdict"] != "passed" or missing:
            checks.append(_not_run(f"{label}: checks that did not run", "; ".join(missing) or f"verdict {report['verdict']}"))
    return checks


def _target(name: str, value, limit: str, met, device: str) -> dict:
    """A performance target; met None (not measured: listed as not run) where its row is absent or skipped."""
    return {"target": name, "value": value, "limit": limit, "met": None if value is None else met, "device": device}


def _kernel_figures(data: dict | None, device: str, step: dict, out: Path) -> tuple[list[dict], list[dict], list[dict]]:
    rows = (data or {}).get("rows", [])
    figures = [{"device": device, "source": "bench_kernels.py", **row} for row in rows]
    checks = _absent("bench_kernels.py", out / "bench-kernels.json", step) if data is None else []
    log = out / "bench_kernels.log"
    why = re.search(r"CUDA kernels skipped: (.*)", log.read_text(errors="replace")) if log.is_file() else None
    targets = []
    for impl in KERNEL_IMPLS:
        if data is not None and not any(r.get("impl") == impl for r in rows):
            checks.append(_not_run(f"bench_kernels.py: the {impl} kernels", why.group(1) if why and impl == "cuda" else "no rows"))
        best = max((r["speedup"] for r in rows if r.get("impl") == impl and r.get("benchmark") == "compaction"
                    and r.get("seq") == KERNEL_SEQ), default=None)
        targets.append(_target(f"{impl} fused compaction vs torch reference at {KERNEL_SEQ} tokens", best,
                               f">= {COMPACTION_SPEEDUP}x", best is not None and best >= COMPACTION_SPEEDUP, device))
    return figures, checks, targets


def _bench_figures(data: dict | None, device: str, step: dict, out: Path) -> tuple[list[dict], list[dict], list[dict]]:
    """bench --device cuda: its rows; a failed check for rows that raised, a not-run one for every suite absent and
    every row skipped (a ``skipped`` field, or a value "skipped: ..."); its overhead targets."""
    results = (data or {}).get("results", {})
    figures = [{"source": f"bench {suite}", **row, "device": f"the host CPU of {device}" if row.get("device") == "cpu" else device}
               for suite, rows in results.items() for row in rows]
    checks = _absent("kvzap-export bench --device cuda", out / "bench-cuda.json", step) if data is None else []
    skipped, errors = {}, [f"{suite}: {row['error']}" for suite, rows in results.items() for row in rows if "error" in row]
    for suite, rows in results.items():
        for row in rows:
            for key, value in row.items():
                if key == "skipped" or (isinstance(value, str) and value.startswith("skipped")):
                    why = f"{suite}: {value if key == 'skipped' else f'{key} {value}'}"
                    skipped[why] = skipped.get(why, 0) + 1
    if data is not None:
        skipped.update({f"{suite}: suite absent from the report": 1 for suite in BENCH_SUITES if suite not in results})
    if errors:
        checks.append({"check": "kvzap-export bench --device cuda: rows that raised", "status": "failed", "detail": errors})
    if skipped:
        checks.append(_not_run("kvzap-export bench --device cuda: rows that did not run",
                               "; ".join(f"{why} ({n} row{'s' * (n > 1)})" for why, n in skipped.items())))
    decode, prefill = [], []
    for row in results.get("overhead", []):
        if row.get("variant") != "mlp" or "skipped" in row:
            continue
        if row.get("phase") == "decode" and "overhead_graphed_time_pct" in row:
            value = row["overhead_graphed_time_pct"]
            decode.append(_target(f"decode at {row['kv_len']}: MLP scoring + decision / attention block (CUDA graphs)",
                                  value, f"<= {DECODE_LIMIT_PCT}%", value <= DECODE_LIMIT_PCT, device))
        if row.get("phase") == "prefill" and row.get("q_len", 0) >= 32768 and "overhead_time_pct" in row:
            value = row["overhead_time_pct"]
            prefill.append(_target(f"prefill {row['q_len']}: MLP scoring + {row['compaction']} / attention block",
                                   value, f"<= {PREFILL_LIMIT_PCT}%", value <= PREFILL_LIMIT_PCT, device))
    decode = decode or [_target("decode at 32768: MLP scoring + decision / attention block (CUDA graphs)", None,
                                f"<= {DECODE_LIMIT_PCT}%", None, device)]
    prefill = prefill or [_target("prefill 32768: MLP scoring + compaction / attention block", None,
                                  f"<= {PREFILL_LIMIT_PCT}%", None, device)]
    return figures, checks, decode + prefill


def _ragged(data: dict | None, device: str, step: dict, out: Path) -> tuple[list[dict], list[dict], list[dict]]:
    """scripts/bench_ragged_decode.py's report: its rows (exactness, attention, layer, parts, replay); its exactness
    and replay checks, its sections that raised (failed), its sections without rows, its rows skipped past its time
    budget and a partial report (not run); its targets."""
    if not data:
        return [], _absent("scripts/bench_ragged_decode.py", out / "ragged-decode.json", step), []
    replay = [data["replay"]] if data.get("replay") else []
    figures = [{"source": f"bench_ragged_decode.py {section}", **row, "device": row.get("device", device)}
               for section in ("exactness", "attention", "layer", "parts") for row in data.get(section) or []]
    figures += [{"source": "bench_ragged_decode.py replay", **row, "device": row.get("device", device)} for row in replay]
    checks = [{"check": f"ragged exactness: {r.get('kernel')} vs the float32 formula",
               "status": "passed" if r.get("passed") else "failed",
               "detail": f"max abs error {r.get('max_abs_err')}"} for r in data.get("exactness") or []]
    checks += [{"check": "ragged layer step: CUDA graph replay vs eager, 50 steps", "status": "passed" if r.get("passed") else "failed",
                "detail": {k: r.get(k) for k in ("bookkeeping_equal", "max_abs_diff_attention", "max_abs_diff_layer",
                                                  "stores_max_abs_diff", "evicted_fraction")}} for r in replay]
    errors = data.get("errors") or []
    checks += [{"check": f"ragged section {e.get('section')}", "status": "failed", "detail": e.get("error")} for e in errors]
    raised = {e.get("section") for e in errors}
    checks += [_not_run(f"ragged section {section}", "no rows: not reached, or every row skipped")
               for section in RAGGED_SECTIONS if not data.get(section) and section not in raised]
    if data.get("skipped"):
        checks.append(_not_run("ragged rows skipped", data["skipped"]))
    if data.get("partial"):
        checks.append(_not_run("ragged benchmark's end", "the report is partial: the run stopped before its last section"))
    targets = [_target(t.get("name"), t.get("value"), f"<= {t.get('limit')}", bool(t.get("passed")), t.get("device", device))
               for t in data.get("targets", [])]
    return figures, checks, targets


def summarize(out: Path) -> tuple[dict, int]:
    kernels, bench, ragged = _json(out / "bench-kernels.json"), _json(out / "bench-cuda.json"), _json(out / "ragged-decode.json")
    device = next((d for d in ((kernels or {}).get("meta", {}).get("device"), (bench or {}).get("machine"),
                               (ragged or {}).get("device"), engine_device(out)) if d), _gpu_name())
    bundles = dict(line.split("\t") for line in (out / "bundles.tsv").read_text().splitlines()) \
        if (out / "bundles.tsv").is_file() else {}
    steps = {s["step"]: {**s, "result": _step_check(s, out)} for s in _steps(out, bundles)}
    checks = [s["result"] for s in steps.values()] + _pytest(out, steps) + _sanitizer(out, steps["sanitizer_memcheck"]) \
        + _validates(out, bundles, steps)
    figures, targets = [], []
    for part, data, step in ((_kernel_figures, kernels, "bench_kernels"), (_bench_figures, bench, "bench_cuda"),
                             (_ragged, ragged, "bench_ragged_decode")):
        more_figures, more_checks, more_targets = part(data, device, steps[step], out)
        figures, checks, targets = figures + more_figures, checks + more_checks, targets + more_targets
    more_figures, more_checks, more_targets = engine_parts(out, steps, device)
    figures, checks, targets = figures + more_figures, checks + more_checks, targets + more_targets
    failed = [c["check"] for c in checks if c["status"] == "failed"]
    not_run = [c["check"] for c in checks if c["status"] == "not run"] + \
        [f"target: {t['target']}" for t in targets if t["met"] is None]
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
    from kvzap_export.provenance import checkout_commit

    return os.environ.get("GPU_CHECK_COMMIT") or checkout_commit(Path(__file__).resolve().parents[1])


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def markdown(summary: dict) -> str:
    """✓ passed, ✗ failed, – not run; the top says what failed and every item that did not run, with why."""
    lines = [f"# GPU check: {summary['verdict'].upper()}", "",
             f"{summary['device']} · {summary['date']} · commit {summary['commit']}", ""]
    why = {c["check"]: c["detail"] for c in summary["checks"]}
    why.update({f"target: {t['target']}": "not measured (its row is absent or was skipped)" for t in summary["targets"]})
    for title, names in (("Failed", summary["failed"]), ("Did not run", summary["not_run"])):
        if names:
            lines += [f"{title} ({len(names)}):", ""] + [f"- {n}: {why.get(n, '')}" for n in names] + [""]
    mark = {"passed": "✓", "failed": "✗", "not run": "–"}
    lines += ["## Checks", ""] + [f"- {mark[c['status']]} {c['check']}: {c['detail']}" for c in summary["checks"]]
    lines += ["", "## Targets (performance; met / missed does not set the verdict, not measured does)", ""]
    lines += [f"- {'– not measured' if t['met'] is None else 'met' if t['met'] else 'MISSED'}: {t['target']}: "
              f"{_fmt(t['value'])} (limit {t['limit']}; {t['device']})" + (f"; {t['note']}" if t.get("note") else "")
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
