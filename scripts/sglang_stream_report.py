"""Every figure of a ``kvzap-export bench --engine sglang --json`` document as Markdown (for docs/benchmarks.md).

    python scripts/sglang_stream_report.py docs/bench/sglang-stream-DATE.json > section.md

Prints the settings and provenance, the dense backend probe, the medians with their spread per configuration,
the ratios against the baseline (dense, or dense with the radix cache when the prompts share a prefix), the decode step per batch size, the bytes of every buffer, and each run's figures
(including each prefill step), so that the page shows all that the JSON holds.
"""

from __future__ import annotations

import argparse
import json
import sys

SCALARS = (("output tokens/s (whole stream)", "tokens_per_s", 2), ("requests/s", "requests_per_s", 3),
           ("wall (s)", "wall_s", 1), ("TTFT p50 (s)", "ttft_p50_s", 2), ("TTFT p90 (s)", "ttft_p90_s", 2),
           ("inter-token p50 (s)", "itl_p50_s", 3), ("inter-token p90 (s)", "itl_p90_s", 3),
           ("most running at once", "max_running", 0), ("K/V entries after a prompt (mean)", "kv_held_after_prefill", 0),
           ("K/V entries at the peak", "kv_peak_entries", 0), ("freed at each request's peak", "freed_at_peak", 3),
           ("prefill s per 1k prompt tokens computed", "prefill_s_per_1k_tokens", 3),
           ("prefill s (all extend steps)", "prefill_s", 1),
           ("prompt tokens from the radix cache", "radix_hit_rate", 3))


def number(value, digits: int) -> str:
    if value is None:
        return "–"
    if digits == 0:
        return f"{value:,.0f}"
    return f"{value:,.{digits}f}"


def spread(entry: dict, digits: int) -> str:
    if entry["median"] is None:
        return "–"
    if entry["min"] == entry["max"]:
        return number(entry["median"], digits)
    return f"{number(entry['median'], digits)} [{number(entry['min'], digits)}–{number(entry['max'], digits)}]"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def report(doc: dict) -> str:
    settings, summary, versus, runs = doc["settings"], doc["summary"], doc["vs_dense"], doc["runs"]
    labels = list(summary)
    baseline = settings.get("baseline", "dense")  # documents before --configs: always dense
    shared = settings.get("shared_prefix_tokens") or 0
    out = [f"Machine: {doc['machine']}. Date: {doc['date']}. Settings: {settings['requests']} requests × "
           f"{settings['prompt_tokens']} prompt tokens{f' (the first {shared} shared by all)' if shared else ''} × "
           f"{settings['new_tokens']} new tokens, pool "
           f"{settings['pool_tokens']:,} dense tokens, {settings['rounds']} interleaved rounds; engine arguments "
           f"`{json.dumps(settings['engine_args'])}`; prompts sha256 `{settings['prompts_sha256'][:16]}…` "
           f"({settings['prompt_source']}); surrogate {settings['surrogate']['variant']} sha256 "
           f"`{(settings['surrogate']['sha256'] or '')[:16]}…`; pruning `{json.dumps(settings['pruning'])}`.", ""]
    probe = doc["dense_backend"]
    if probe["candidates"]:
        found = "; ".join(f"{name}: " + (f"{c['tokens_per_s']:.2f} tokens/s, wall {c['wall_s']:.1f} s" if "tokens_per_s" in c
                                         else f"failed ({c['error']})") for name, c in probe["candidates"].items())
        overlap = {True: ", overlap scheduler on", False: ", overlap scheduler off"}.get(probe.get("overlap"), "")
        out += [f"Dense baseline: SGLang's `{probe['chosen']}` attention backend{overlap}, the fastest on a probe stream "
                f"({probe['probe']['requests']} requests × {probe['probe']['new_tokens']} new tokens"
                f"{', radix cache on' if probe['probe'].get('radix_cache') else ''}): {found}.", ""]
    else:
        out += [f"Dense baseline: SGLang's `{probe['chosen']}` attention backend (chosen on the command line).", ""]
    if "kvzap_overlap" in settings:  # documents before --kvzap-overlap: on (the per-run table shows each run's)
        out += [f"KVzap's configurations: SGLang's overlap scheduler {'on' if settings['kvzap_overlap'] else 'off'} "
                f"(`--kvzap-overlap`).", ""]
    out += ["Medians over rounds [min–max]:", "",
            table(["figure", *labels], [[name, *[spread(summary[label][key], digits) for label in labels]]
                                        for name, key, digits in SCALARS if key in summary[labels[0]]]), ""]
    ratio = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
    rows = [["output tokens/s (ratio of medians)", *[ratio(versus[label]["tokens_per_s_ratio"]) for label in versus]],
            ["output tokens/s, ratio within each round",
             *[", ".join(f"{v:.2f}" for v in versus[label]["tokens_per_s_ratio_per_round"]) for label in versus]],
            ["most running at once", *[ratio(versus[label]["running_ratio"]) for label in versus]],
            ["predicted from the memory freed, 1 / (1 − freed at peak)",
             *[ratio(versus[label]["running_ratio_predicted"]) for label in versus]],
            ["running / predicted", *[ratio(versus[label]["running_vs_predicted"]) for label in versus]],
            ["prefill time per 1k prompt tokens", *[ratio(versus[label]["prefill_ratio"]) for label in versus]],
            ["decode step at equal batch (batch: ratio)",
             *[", ".join(f"{n}: {r:.2f}" for n, r in versus[label]["decode_step_ratio_at_equal_batch"].items()) or "–"
               for label in versus]]]
    out += [f"Against {baseline}:", "", table(["figure", *versus], rows), ""]
    sizes = sorted({n for label in labels for n in summary[label]["decode_step_s"]}, key=int)
    out += ["Decode step (s) per batch size, medians over rounds [min–max]:", "",
            table(["batch", *labels], [[n, *[spread(summary[label]["decode_step_s"][n], 3)
                                             if n in summary[label]["decode_step_s"] else "–" for label in labels]]
                                       for n in sizes]), ""]
    names = sorted({k for label in labels for k in summary[label]["bytes"]})
    out += ["Bytes of every buffer at the busiest step (largest over rounds):", "",
            table(["buffer", *labels], [[name, *[number(summary[label]["bytes"].get(name), 0) for label in labels]]
                                        for name in names] + [["total", *[number(sum(summary[label]["bytes"].values()), 0)
                                                                         for label in labels]]]), ""]
    keys = ("tokens_per_s", "requests_per_s", "wall_s", "ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p90_s", "max_running",
            "kv_held_after_prefill", "kv_peak_entries", "kv_pool_entries", "freed_at_peak", "prefill_s_per_1k_tokens",
            "prefill_s", "radix_hit_rate", "output_tokens", "finished", "launch_s")
    keys = tuple(k for k in keys if any(k in r["figures"] for r in runs))
    cell = lambda v: number(v, 3) if isinstance(v, float) else ("–" if v is None else str(v))  # noqa: E731
    out += ["Each run, in the order they ran:", "",
            table(["round", "configuration", "backend", "radix cache", "overlap", *keys],
                  [[str(r["round"]), r["label"], str(r["attention_backend"]),
                    {True: "on", False: "off"}.get(r.get("radix_cache"), "off"),
                    {True: "on", False: "off"}.get(r.get("overlap_schedule"), "off"),
                    *[cell(r["figures"].get(k)) for k in keys]] for r in runs]), ""]
    out += ["Each run's decode steps (batch: steps, median s) and prefill steps (prompts × seconds):", ""]
    for r in runs:
        f = r["figures"]
        decode = ", ".join(f"{n}: {f['decode_steps'][n]} × {f['decode_step_s'][n]:.3f}" for n in f["decode_step_s"])
        prefill = ", ".join(f"{e['prompts']} × {e['seconds']:.2f}" for e in f["extend_steps"])
        out.append(f"- round {r['round']}, {r['label']}: decode {decode}; prefill {prefill}")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Render every figure of a `kvzap-export bench --engine sglang "
                                                 "--json` document as Markdown on stdout.")
    parser.add_argument("bench_json", help="the JSON written by `kvzap-export bench --engine sglang --json`")
    args = parser.parse_args(argv)
    try:
        with open(args.bench_json) as handle:
            doc = json.load(handle)
    except OSError as error:
        parser.exit(2, f"error: cannot read {args.bench_json}: {error.strerror}\n")
    except json.JSONDecodeError as error:
        parser.exit(2, f"error: {args.bench_json} is not JSON ({error.msg} at line {error.lineno}); "
                       "give the file `kvzap-export bench --engine sglang --json` wrote\n")
    missing = [key for key in ("settings", "summary", "vs_dense", "runs") if not isinstance(doc, dict) or key not in doc]
    if missing:
        parser.exit(2, f"error: {args.bench_json} lacks {', '.join(missing)}: not a `bench --engine sglang --json` "
                       "document\n")
    sys.stdout.write(report(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
