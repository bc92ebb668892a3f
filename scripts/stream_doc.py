"""The SGLang stream records' parts of the benchmark docs (``bench_doc.py`` draws them): a record's headline, a suite's
block in docs/benchmarks.md (one record, or several runs of one code path: the medians over them, then each run), and a
record's full rendering (docs/bench/<record>.md, every figure it holds). ``fmt`` formats one value for every table."""

from __future__ import annotations

import json
import statistics

from sglang_stream_report import SCALARS, report, spread, table

from kvzap_export.bench.stream_figures import compare

SHOWN = {key for _, key, _ in SCALARS} | {"requests_per_s", "kv_pool_entries", "output_tokens", "finished", "launch_s",
                                           "decode_step_s", "decode_steps", "extend_steps", "bytes"}  # by report()


def fmt(value) -> str:
    if value is None or isinstance(value, bool):
        return {None: "–", True: "yes", False: "no"}[value]
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {fmt(v)}" for k, v in value.items())
    return str(value)


def shares(doc: dict) -> dict[str, dict]:
    """KVzap's own share: each configuration against the same code with KVzap off (stream_figures.compare)."""
    pairs = {label: f"{label}, KVzap off" for label in doc["summary"] if f"{label}, KVzap off" in doc["summary"]}
    return {label: compare(doc["summary"], doc["runs"], baseline=off)[label] | {"off": off} for label, off in pairs.items()}


def stream_headline(doc: dict) -> str:
    base, n = doc["settings"].get("baseline", "dense"), doc["settings"]["rounds"]
    ratios = "; ".join(f"{lab}: {v['tokens_per_s_ratio']:.2f}×" for lab, v in doc["vs_dense"].items())
    own = "; ".join(f"{lab} ÷ {v['off']}: {v['tokens_per_s_ratio']:.2f}×" for lab, v in shares(doc).items())
    return (f"output tokens/s ÷ {base} ({doc['summary'][base]['tokens_per_s']['median']:.2f}), "
            f"{'one round' if n == 1 else f'medians of {n} rounds'}: {ratios}" + (f". KVzap's own share, {own}" if own else ""))


def ratios(values) -> str:
    """Ratios as the docs list them: "1.44, 1.47, 1.45"."""
    return ", ".join(f"{v:.2f}" for v in values)


def run_ratios(docs: list[dict]) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each configuration's tokens/s ratio to the baseline in each record (its median over its rounds), and each
    KVzap share's (keyed "label ÷ label, KVzap off"), as the first record has them."""
    versus = {label: [d["vs_dense"][label]["tokens_per_s_ratio"] for d in docs] for label in docs[0]["vs_dense"]}
    each = [shares(d) for d in docs]
    own = {f"{label} ÷ {share['off']}": [s[label]["tokens_per_s_ratio"] for s in each]
           for label, share in each[0].items()}
    return versus, own


def several_headline(docs: list[dict]) -> str:
    """The headline of a stream suite with several records (runs of one code path): medians over the runs."""
    versus, own = run_ratios(docs)
    listed = lambda vals: f"{statistics.median(vals):.2f}× ({ratios(vals)})"  # noqa: E731
    return (f"output tokens/s ÷ {docs[0]['settings'].get('baseline', 'dense')}, median of {len(docs)} runs (each the "
            f"median of its {docs[0]['settings']['rounds']} rounds): "
            + "; ".join(f"{label}: {listed(v)}" for label, v in versus.items())
            + (". KVzap's own share, " + "; ".join(f"{k}: {listed(v)}" for k, v in own.items()) if own else ""))


def stream_runs(suite, recs, docs: list[dict]) -> list[str]:
    """A stream suite's several records (``docs``): the medians over them, then one row per run."""
    base = docs[0]["settings"].get("baseline", "dense")
    versus, own = run_ratios(docs)
    pruning = [label for label in versus if f"{label}, KVzap off" in docs[0]["summary"]]
    out = [f"**{label}: {statistics.median(versus[label]):.2f}× {base}**, the median of {len(docs)} runs of this code "
           f"path (each run's ratio of medians over its rounds: {ratios(versus[label])})." for label in pruning]
    out += [f"**KVzap's own share, {k}: {statistics.median(v):.2f}×** ({ratios(v)})." for k, v in own.items()]
    rows = [[f"[{i}](bench/{n})", recs.commit(n)[0], recs.date(n), f"{d['summary'][base]['tokens_per_s']['median']:.2f}",
             *[f"{v[i - 1]:.2f}" for v in (*versus.values(), *own.values())]]
            for i, (n, d) in enumerate(zip(suite.records, docs), 1)]
    head = ["run", "commit", "date", f"{base} tokens/s", *[f"{label} ÷ {base}" for label in versus],
            *[f"share: {k}" for k in own]]
    return [*out, "", "Each run (medians over its rounds):", "", table(head, rows), "",
            f"Run 1 in detail ({suite.records[0]}):", ""]


def stream_block(suite, recs) -> str:
    docs = [recs.load(n) for n in suite.records]
    name, doc = suite.records[0], docs[0]
    s, summary, versus, probe = doc["settings"], doc["summary"], doc["vs_dense"], doc["dense_backend"]
    base = s.get("baseline", "dense")
    shared = f" (the first {s['shared_prefix_tokens']} shared by all)" if s.get("shared_prefix_tokens") else ""
    overlap = {r["label"]: {True: "on", False: "off"}.get(r.get("overlap_schedule"), "–") for r in doc["runs"]}
    if len(docs) == 1:
        out = [(f"- Record: [`bench/{name}`](bench/{name}); every figure it holds: [`bench/{name[:-5]}.md`]"
                f"(bench/{name[:-5]}.md) (generated)."), f"- {recs.provenance(name)}"]
    else:
        out = [("- Records, runs of one code path at these settings: " + ", ".join(
                f"[`bench/{n}`](bench/{n}) ([.md](bench/{n[:-5]}.md))" for n in suite.records)
                + "; each .md (generated) holds every figure of its record."), f"- Run 1: {recs.provenance(name)}"]
    out += [f"- Command: `{suite.command or doc['command']}`",
            (f"- Workload: {s['requests']} requests × {s['prompt_tokens']} prompt tokens{shared} × {s['new_tokens']} "
             f"new tokens, a pool of {s['pool_tokens']:,} dense tokens, {s['rounds']} interleaved rounds. Baseline "
             f"({base}): SGLang's `{probe['chosen']}` backend, the fastest of its probe. SGLang's overlap scheduler: "
             + "; ".join(f"{label}: {on}" for label, on in overlap.items()) + "."), ""]
    if len(docs) > 1:
        out += stream_runs(suite, recs, docs)
    for label, share in shares(doc).items():
        v = versus[label]
        out += [(f"**{label}: {v['tokens_per_s_ratio']:.2f}× {base}** in output tokens/s over the whole stream "
                 f"({summary[label]['tokens_per_s']['median']:.2f} against {summary[base]['tokens_per_s']['median']:.2f}"
                 f", medians over the rounds; within each round {ratios(v['tokens_per_s_ratio_per_round'])}). **KVzap's "
                 f"own share: {share['tokens_per_s_ratio']:.2f}×** (against {share['off']}: the same code with KVzap "
                 f"off; within each round {ratios(share['tokens_per_s_ratio_per_round'])})."), ""]
    cols = ["configuration", "output tokens/s", f"÷ {base}", f"÷ {base}, each round", "most running", "freed at peak",
            "TTFT p50 (s)", "inter-token p50 (s)", "prefill s / 1k tokens"]
    rows = [[label, spread(e["tokens_per_s"], 2), "–" if label == base else f"{versus[label]['tokens_per_s_ratio']:.2f}",
             "–" if label == base else ratios(versus[label]["tokens_per_s_ratio_per_round"]),
             spread(e["max_running"], 0), spread(e["freed_at_peak"], 3), spread(e["ttft_p50_s"], 2),
             spread(e["itl_p50_s"], 3), spread(e["prefill_s_per_1k_tokens"], 3)] for label, e in summary.items()]
    return "\n".join(out) + "\nMedians over the rounds [min–max]:\n\n" + table(cols, rows) + "\n"


def stream_full(name: str, doc: dict) -> str:
    """Every figure of a stream record: sglang_stream_report's rendering, then what it leaves out."""
    runs = doc["runs"]
    extra = [k for k in dict.fromkeys(k for r in runs for k in r["figures"]) if k not in SHOWN | {"tokens_per_s"}]
    settings = [k for k in dict.fromkeys(k for r in runs for k in r)
                if k not in ("round", "label", "attention_backend", "radix_cache", "overlap_schedule", "figures")]
    rows = [[str(r["round"]), r["label"], *[fmt(r.get(k)) for k in settings], *[fmt(r["figures"].get(k)) for k in extra],
             ", ".join(str(e["prompt_tokens"]) for e in r["figures"]["extend_steps"])] for r in runs]
    return (f"# {name}: every figure it holds\n\nGenerated by `python scripts/bench_doc.py` from [{name}]({name}) "
            "(`scripts/sglang_stream_report.py`'s rendering, then what that leaves out); do not edit.\n\n"
            + report(doc) + "\nEach run's settings and the figures the tables above leave out:\n\n"
            + table(["round", "configuration", *settings, *extra, "prompt tokens of each prefill step"], rows)
            + f"\n\nAlso in the record: command `{doc.get('command')}`, device `{doc.get('device')}`, errors "
              f"`{json.dumps(doc.get('errors'))}`, settings `{json.dumps(doc['settings'])}`.\n")
