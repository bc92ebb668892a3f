#!/usr/bin/env python
"""The README's main command (and optionally the test suite) idle, then beside busy processes, back to back.

    python scripts/bench_main_command.py                       # main command: idle, then beside 2 x `yes > /dev/null`
    python scripts/bench_main_command.py --suite "-m 'not slow'"   # the test suite too (pytest arguments)
    python scripts/bench_main_command.py --busy 2 --runs 1 --env OMP_WAIT_POLICY=PASSIVE

Each run is a child process; its wall time, user+sys CPU time and context switches come from ``os.wait4``
(the child and its descendants). Busy processes are started just before a loaded run and killed right after
it. CPU time is the robust figure on a shared machine: wall time depends on what else runs, CPU time mostly
on what the command itself does (spinning or barrier-bound thread pools show up as CPU time that grows under
load). Prints one markdown table; ``--json`` prints the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_once(command: list[str], env: dict[str, str], busy: int, cwd: Path) -> dict:
    """One run of ``command`` beside ``busy`` processes spinning on the CPU (``yes > /dev/null``)."""
    spinners = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(busy)]
    try:
        start = time.perf_counter()
        child = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _pid, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - start
        stderr = child.stderr.read().decode(errors="replace") if child.stderr else ""
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    code = os.waitstatus_to_exitcode(status)
    return {"busy": busy, "exit": code, "wall_s": wall, "user_s": usage.ru_utime, "sys_s": usage.ru_stime,
            "cpu_s": usage.ru_utime + usage.ru_stime, "voluntary_cs": usage.ru_nvcsw, "involuntary_cs": usage.ru_nivcsw,
            "max_rss_mib": usage.ru_maxrss / 1024, "stderr_tail": stderr[-400:] if code != 0 else ""}


def main_command(out: Path, extra: list[str]) -> list[str]:
    exe = shutil.which("kvzap-export")
    base = [exe] if exe else [sys.executable, "-m", "kvzap_export.cli.main"]
    return [*base, "--model", "smollm2-135m", "--out", str(out), "--force", "--quiet", *extra]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--busy", type=int, default=2, help="busy processes beside the loaded run (default 2)")
    parser.add_argument("--runs", type=int, default=1, help="idle/loaded pairs, back to back (default 1)")
    parser.add_argument("--extra", default="", help="extra arguments of the main command, e.g. '--no-validate'")
    parser.add_argument("--suite", default=None, metavar="PYTEST_ARGS",
                        help="also time `python -m pytest -q PYTEST_ARGS` idle and loaded (e.g. \"-m 'not slow'\")")
    parser.add_argument("--skip-main", action="store_true", help="time only the test suite")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="environment of the timed runs")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()

    env = dict(os.environ)
    for item in args.env:
        name, _, value = item.partition("=")
        env[name] = value
    jobs: list[tuple[str, list[str]]] = []
    scratch = Path(tempfile.mkdtemp(prefix="bench-main-"))
    if not args.skip_main:
        jobs.append(("main command", main_command(scratch / "engine", shlex.split(args.extra))))
    if args.suite is not None:
        jobs.append(("test suite", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *shlex.split(args.suite)]))
    rows = []
    try:
        for name, command in jobs:
            for _ in range(args.runs):
                for busy in (0, args.busy):
                    row = {"job": name, **run_once(command, env, busy, ROOT)}
                    rows.append(row)
                    print(f"{name}: busy {busy}: {row['wall_s']:.1f} s wall, {row['cpu_s']:.1f} s CPU, exit {row['exit']}",
                          file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    from kvzap_export.bench.timing import machine

    print(f"machine: {machine('cpu')}; load average before: {os.getloadavg()[0]:.2f}; "
          f"env: {' '.join(args.env) or '(default)'}; date: {time.strftime('%Y-%m-%d %H:%M')}")
    print("| job | busy processes | exit | wall (s) | user+sys CPU (s) | CPU / wall | voluntary cs | involuntary cs | "
          "wall / idle wall | CPU / idle CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    idle: dict[str, dict] = {}
    for row in rows:
        base = idle.setdefault(row["job"], row) if row["busy"] == 0 else idle.get(row["job"], row)
        print(f"| {row['job']} | {row['busy']} | {row['exit']} | {row['wall_s']:.1f} | {row['cpu_s']:.1f} | "
              f"{row['cpu_s'] / row['wall_s']:.2f} | {row['voluntary_cs']} | {row['involuntary_cs']} | "
              f"{row['wall_s'] / base['wall_s']:.2f} | {row['cpu_s'] / base['cpu_s']:.2f} |")
        if row["busy"] == 0:
            idle[row["job"]] = row
    for row in rows:
        if row["stderr_tail"]:
            print(f"\n{row['job']} (busy {row['busy']}) exit {row['exit']}: {row['stderr_tail']}", file=sys.stderr)


if __name__ == "__main__":
    main()
