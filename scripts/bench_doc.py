"""docs/benchmarks.md's tables, regenerated from the JSON run records under docs/bench so the page cannot drift.

    python scripts/bench_doc.py            # rewrite the generated blocks, the full renderings and docs/bench/INDEX.md
    python scripts/bench_doc.py --check    # change nothing; exit 1 naming the first table that differs from its JSON

The page holds a ``summary`` block and one block per suite between ``<!-- generated: KEY -->`` and
``<!-- end generated -->``; the prose around them is written by hand. docs/bench/suites.yaml declares the suites and
their figures of record (a stream suite of several records, runs of one code path: the medians over them, then each
run). Also generated: docs/bench/<record>.md for each SGLang stream record of a suite (every figure it holds) and
docs/bench/INDEX.md (one line per record). ``--check`` also checks the .md beside each GPU check record
(gpu_check.sh writes both) against gpu_check_summary.py's rendering of its checks, targets and figures.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the renderers beside this script, also when imported

import gpu_check_summary  # noqa: E402
from sglang_stream_report import table  # noqa: E402
from stream_doc import fmt, several_headline, stream_block, stream_full, stream_headline  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GPU_SCHEMA = "kvzap-export-gpu-check/1"
BLOCK = re.compile(r"<!-- generated: (\S+) -->\n(.*?)<!-- end generated -->", re.DOTALL)


class RecordError(Exception):
    """A record or a block is missing or unreadable: the user's to fix, reported in one line."""


@dataclass(frozen=True)
class Suite:
    """One suite of benchmarks.md as docs/bench/suites.yaml declares it (its comments say what each field is)."""
    key: str
    title: str
    kind: str
    records: tuple[str, ...]
    command: str = ""
    beside: tuple[str, ...] = ()
    picks: tuple = ()


class Records:
    """The checkout's JSON records (read once each) and suites.yaml's declarations."""

    def __init__(self, root: Path):
        self.root, self.bench, self._docs = root, root / "docs" / "bench", {}
        data = yaml.safe_load((self.bench / "suites.yaml").read_text())
        self.suites = [Suite(**{k: tuple(v) if isinstance(v, list) else v for k, v in s.items()}) for s in data["suites"]]
        self.decl = data  # published_commit, published_machine, families: see suites.yaml

    def load(self, name: str) -> dict:
        if name not in self._docs:
            try:
                self._docs[name] = json.loads((self.bench / name).read_text())
            except (OSError, ValueError) as error:
                raise RecordError(f"cannot read the record {self.bench / name}: {error}") from None
        return self._docs[name]

    def names(self) -> list[str]:
        return sorted(p.name for p in self.bench.glob("*.json"))

    def commit(self, name: str) -> tuple[str, bool]:
        """The commit measured, and whether the section that published the record gave it (not the record)."""
        if name in self.decl["published_commit"]:
            return self.decl["published_commit"][name], True
        found = re.search(r"-([0-9a-f]{7})\.json$", name)
        return self.load(name).get("commit") or (found.group(1) if found else "–"), False

    def machine(self, name: str) -> str:
        doc = self.load(name)
        device = doc["device"] if isinstance(doc.get("device"), str) else None
        if isinstance(doc.get("machine"), str):
            return doc["machine"] + (f" ({device})" if device else "")
        return device or doc.get("meta", {}).get("device") or self.decl["published_machine"].get(name, "–")

    def date(self, name: str) -> str:
        found = re.search(r"\d{4}-\d{2}-\d{2}", name)
        return self.load(name).get("date") or (found.group(0) if found else "–")

    def provenance(self, name: str) -> str:
        return f"Machine: {self.machine(name)}. Date: {self.date(name)}. Commit: {self.commit(name)[0]}."


def rows_table(rows: list[dict], skip: tuple = ("benchmark",)) -> str:
    """Every key of the rows; a key with one value in every row goes in the line above the table."""
    keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in skip]
    shared = [k for k in keys if len(rows) > 1 and all(k in r for r in rows) and len({fmt(r[k]) for r in rows}) == 1]
    head = f"Every row: {', '.join(f'{k} {fmt(rows[0][k])}' for k in shared)}.\n\n" if shared else ""
    cols = [k for k in keys if k not in shared]
    return head + table(cols, [[fmt(r.get(k)) for k in cols] for r in rows])


def limit_met(value: float, limit: str) -> bool:
    op, bound = re.match(r"\s*([<>]=)\s*([\d.]+)", limit).groups()
    return value <= float(bound) if op == "<=" else value >= float(bound)


def target_values(runs: list[dict]) -> dict[str, tuple[str, list]]:
    """Each target of the first run: its limit and its value in each run (None where a run lacks it)."""
    return {t["target"]: (t["limit"], [next((u["value"] for u in r["targets"] if u["target"] == t["target"]), None)
                                       for r in runs]) for t in runs[0]["targets"]}


def gpu_block(suite: Suite, recs: Records) -> str:
    runs, beside = [recs.load(n) for n in suite.records], [recs.load(n) for n in suite.beside]
    out = [f"- Records: {runs[0]['device']}, " + ", ".join(f"[run {i}](bench/{n}) ([.md](bench/{n[:-5]}.md))"
                                                          for i, n in enumerate(suite.records, 1))
           + "".join(f"; {d['device']}, [one run](bench/{n}) ([.md](bench/{n[:-5]}.md))"
                     for n, d in zip(suite.beside, beside))
           + ". Each .md shows every check and figure of its JSON.",
           *[f"- {d['device']}, {d['date']}, commit {d['commit']}: verdict {d['verdict']}"
             + (f"; failed: {', '.join(d['failed'])}" if d["failed"] else "")
             + (f"; did not run: {', '.join(d['not_run'])}" if d["not_run"] else "") for d in (*runs, *beside)],
           f"- Command, COMMIT being each record's: `{suite.command}`", ""]
    other = target_values(beside) if beside else {}
    cell = lambda v, limit: "–" if v is None else f"{v:#.3g} {'met' if limit_met(v, limit) else 'missed'}"  # noqa: E731
    rows = [[name, limit, *["–" if v is None else f"{v:#.3g}" for v in values],
             "**" + cell(statistics.median(v for v in values if v is not None), limit).replace(" ", "** ", 1),
             *[cell(v, limit) for v in other.get(name, (limit, [None] * len(beside)))[1]]]
            for name, (limit, values) in target_values(runs).items()]
    head = ["target", "limit", *[f"run {i}" for i in range(1, len(runs) + 1)], f"median of {len(runs)}",
            *[f"{d['device']} ({d['commit']}, one run)" for d in beside]]
    return ("\n".join(out) + "\nTargets (the limits are issues 40's and 41's; the figures are ratios):\n\n"
            + table(head, rows) + "\n")


def gpu_md_view(text: str) -> str:
    """What of a GPU check .md the renderer's later versions left alike: title lines, checks, targets, figures."""
    lines = text.splitlines()
    start = lines.index("## Checks") if "## Checks" in lines else len(lines)
    return "\n".join(lines[:3] + [line for line in lines[start:] if not line.startswith("## Targets")])


def picked(suite: Suite, docs: list[dict]) -> str:
    """The suite's headline: each pick's figure, the median over the records where there are several."""
    found = []
    for part, where, figure, words in suite.picks:
        values = [next(r for r in d["results"][part] if where.items() <= r.items())[figure] for d in docs]
        if len(values) == 1:
            found.append(f"{words}: {fmt(values[0])}")
        elif all(isinstance(v, bool) for v in values):
            found.append(f"{words} in {sum(values)} of {len(values)} runs")
        else:
            found.append(f"{words}: {fmt(statistics.median(values))} (median of {len(values)} runs)")
    return "; ".join(found)


def merged(values: list):
    """The median of numbers; any other value as it is where every record agrees."""
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return statistics.median(values)
    return values[0] if len({fmt(v) for v in values}) == 1 else "varies: " + ", ".join(map(fmt, values))


def rows_block(suite: Suite, recs: Records) -> str:
    """Every row of every record; with several records, a run column and the medians over them."""
    docs, first = [recs.load(n) for n in suite.records], suite.records[0]
    links = ", ".join(f"[`bench/{n}`](bench/{n})" for n in suite.records)
    out = [(f"- Record{'s' if len(docs) > 1 else ''}: {links}. {recs.provenance(first)} torch {docs[0]['torch']}. "
            f"Command{', each run' if len(docs) > 1 else ''}: `{suite.command or docs[0]['command']}`."),
           f"- {picked(suite, docs)}.", ""]
    for part in docs[0]["results"]:
        rows = [({"run": i} if len(docs) > 1 else {}) | r for i, d in enumerate(docs, 1) for r in d["results"][part]]
        out += [f"`{part}`{', each run' if len(docs) > 1 else ''}:", "", rows_table(rows), ""]
        if len(docs) > 1:  # row i of every record measures the same thing
            medians = [{k: merged([d["results"][part][i].get(k) for d in docs]) for k in row}
                       for i, row in enumerate(docs[0]["results"][part])]
            out += [f"`{part}`, medians over the {len(docs)} runs:", "", rows_table(medians), ""]
    return "\n".join(out)


def suite_headline(suite: Suite, recs: Records) -> str:
    docs = [recs.load(n) for n in suite.records]
    if suite.kind == "stream":
        return stream_headline(docs[0]) if len(docs) == 1 else several_headline(docs)
    if suite.kind == "gpu-check":
        met = sum(limit_met(statistics.median(v for v in values if v is not None), limit)
                  for limit, values in target_values(docs).values())
        return (f"{met} of {len(docs[0]['targets'])} targets met on the {docs[0]['device']} (median of {len(docs)} runs)"
                + "".join(f"; {sum(bool(t['met']) for t in d['targets'])} of {len(d['targets'])} on the {d['device']} "
                          "(one run)" for d in map(recs.load, suite.beside)))
    return picked(suite, docs)


def summary_block(recs: Records) -> str:
    rows = [[s.title, suite_headline(s, recs), recs.machine(s.records[0]), recs.date(s.records[0]),
             recs.commit(s.records[0])[0], ", ".join(f"[{n}](bench/{n})" for n in s.records + s.beside)]
            for s in recs.suites]
    return table(["suite", "figure of record", "machine", "date", "commit", "record"], rows) + "\n"


def headline(doc: dict) -> str:
    """One record's headline for INDEX.md, by what the record holds."""
    results = doc.get("results", {})
    if "vs_dense" in doc:
        return stream_headline(doc)
    if "sglang_stream" in results:
        rows = {r["mode"]: r for r in results["sglang_stream"]}
        return "output tokens/s over the stream ÷ dense, one run each: " + ", ".join(
            f"{m} {r['tokens_per_s_overall'] / rows['dense']['tokens_per_s_overall']:.2f}×" for m, r in rows.items()
            if m != "dense")
    if "e2e" in results:
        ours = next(r for r in results["e2e"] if r["method"] != "kvpress_masking")
        return (f"suites {', '.join(results)}; e2e: {ours['method']} {ours['kv_fraction_of_kvpress']:.3f} of kvpress's "
                f"K/V bytes at {ours['time_ratio_vs_kvpress']:.2f}× its time per token, tokens identical: "
                f"{fmt(ours['identical_tokens'])}")
    if "on_over_off" in doc:
        on, off = doc["median_tokens_per_s_overlap_on"], doc["median_tokens_per_s_overlap_off"]
        return f"ragged mode, overlap on ÷ off {doc['on_over_off']:.3f} (medians: {on:.2f} against {off:.2f} tokens/s)"
    if "targets" in doc:  # a GPU check, bench_ragged_decode.py, bench_kernels.py
        met = sum(bool(t.get("met", t.get("passed"))) if isinstance(t, dict) else "(met)" in t for t in doc["targets"])
        return (f"verdict {doc['verdict']}; " if "verdict" in doc else "") + f"{met} of {len(doc['targets'])} targets met"
    return "–"


def index(recs: Records) -> str:
    of_record = {n: s.title for s in recs.suites for n in (*s.records, *s.beside)}
    rows = []
    for name in recs.names():
        commit, published = recs.commit(name)
        family = next((title for prefix, title in recs.decl["families"].items() if name.startswith(prefix)), "–")
        mark = f" (figure of record: {of_record[name]})" if name in of_record else ""
        rows.append([f"[{name}]({name}){mark}", recs.date(name), commit + (" †" if published else ""), family,
                     recs.machine(name), headline(recs.load(name))])
    rows.sort(key=lambda r: r[1])
    return ("# Benchmark records\n\nGenerated by `python scripts/bench_doc.py` from the JSON in this folder, one line "
            "per record; do not edit. The current figures: [benchmarks.md](../benchmarks.md); superseded runs as they "
            "were published: [benchmarks-history.md](../benchmarks-history.md). † the commit the section that "
            "published the record gave (the record holds none, or the device copy's).\n\n"
            + table(["record", "date", "commit", "suite", "machine", "headline"], rows) + "\n")


BLOCKS = {"stream": stream_block, "gpu-check": gpu_block, "rows": rows_block}


def generated(recs: Records) -> tuple[dict[str, tuple[str, str]], dict[Path, tuple[str, str]]]:
    """benchmarks.md's blocks, {key: (text, the records it comes from)}, and every generated file, {path: (text,
    the records)}: the page with those blocks, each stream record's full rendering, INDEX.md."""
    page = recs.root / "docs" / "benchmarks.md"
    text = page.read_text()
    found = [m.group(1) for m in BLOCK.finditer(text)]
    if sorted(found) != sorted(["summary", *(s.key for s in recs.suites)]):
        raise RecordError(f"{page} holds the blocks {found}; docs/bench/suites.yaml wants `summary` and "
                          f"{[s.key for s in recs.suites]}, each between `<!-- generated: KEY -->` and "
                          "`<!-- end generated -->`")
    for suite in (s for s in recs.suites if s.kind not in BLOCKS):
        raise RecordError(f"docs/bench/suites.yaml: suite {suite.key} has kind {suite.kind!r}; kinds: {sorted(BLOCKS)}")
    blocks = {s.key: (BLOCKS[s.kind](s, recs), ", ".join(s.records + s.beside)) for s in recs.suites}
    blocks["summary"] = (summary_block(recs), "every suite's records")  # last: a suite's own table names its records
    fill = lambda m: f"<!-- generated: {m.group(1)} -->\n{blocks[m.group(1)][0]}<!-- end generated -->"  # noqa: E731
    files = {page: (BLOCK.sub(fill, text), "the blocks")}
    files |= {recs.bench / f"{n[:-5]}.md": (stream_full(n, recs.load(n)), n)
              for s in recs.suites if s.kind == "stream" for n in s.records}
    return blocks, files | {recs.bench / "INDEX.md": (index(recs), "the JSON records under docs/bench")}


def first_difference(want: str, have: str) -> str:
    for i, (x, y) in enumerate(zip(want.splitlines(), have.splitlines()), 1):
        if x != y:
            return f"line {i}: the JSON gives `{x}`, the file has `{y}`"
    return f"the JSON gives {len(want.splitlines())} lines, the file has {len(have.splitlines())}"


def check(root: Path) -> str | None:
    """None when every generated table equals its JSON; otherwise what differs first."""
    recs = Records(root)
    blocks, files = generated(recs)
    have = {m.group(1): m.group(2) for m in BLOCK.finditer((root / "docs" / "benchmarks.md").read_text())}
    wrong = [(f"docs/benchmarks.md: the table `{k}`", want, have[k], src) for k, (want, src) in blocks.items()]
    wrong += [(str(p.relative_to(root)), want, p.read_text() if p.is_file() else "", src)
              for p, (want, src) in files.items()]
    for name in (n for n in recs.names() if recs.load(n).get("schema") == GPU_SCHEMA):
        beside = recs.bench / f"{name[:-5]}.md"  # written with its JSON by gpu_check.sh
        if beside.is_file():
            wrong.append((str(beside.relative_to(root)), gpu_md_view(gpu_check_summary.markdown(recs.load(name))),
                          gpu_md_view(beside.read_text()), f"{name} (gpu_check.sh wrote both; this script only compares)"))
    return next((f"{what} differs from {src}: {first_difference(want, found)}"
                 + ("" if "gpu_check.sh" in src else " (run `python scripts/bench_doc.py`)")
                 for what, want, found, src in wrong if want != found), None)


def write(root: Path) -> list[Path]:
    """Writes what differs; returns the files written."""
    written = []
    for path, (want, _) in generated(Records(root))[1].items():
        if not path.is_file() or path.read_text() != want:
            path.write_text(want)
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 naming the first table that differs from its JSON")
    parser.add_argument("--root", type=Path, default=REPO, help="the checkout that holds docs/ (default: this one)")
    args = parser.parse_args(argv)
    try:
        if not args.check:
            print("".join(f"wrote {path.relative_to(args.root)}\n" for path in write(args.root)), end="")
            return 0
        problem = check(args.root)
    except RecordError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(problem or "docs/benchmarks.md, the full renderings and docs/bench/INDEX.md equal their JSON records")
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main())
