"""The targets and the console report of ``scripts/bench_ragged_decode.py`` (issue 41's GPU lines)."""

from __future__ import annotations

# (section, batch, T, pruned, limit, the row's field): issue 41's lines read the kernel alone (the engine lays out
# every layer's rows once per step); the same rows with a whole layout of their layer per call, and the layer step
# (which captures that layout in its graph), are the conservative reading
TARGETS = [(section, 16, 32768, 0.7, 0.5, field) for section, field in (("attention", "kernel_only_ratio"),
                                                                      ("attention", "ratio"))]
TARGETS += [(section, 16, 32768, 0.4, 0.8, field) for section, field in (("attention", "kernel_only_ratio"),
                                                                       ("attention", "ratio"))]
TARGETS += [("attention", 1, 32768, 0.7, 1.0, "kernel_only_ratio"), ("attention", 1, 32768, 0.7, 1.0, "ratio"),
            ("layer", 16, 32768, 0.7, 0.65, "ratio"), ("layer", 16, 32768, 0.4, 0.95, "ratio")]
FIELD_NAMES = {"kernel_only_ratio": "SGLang's kernel alone", "ratio": "with its layout"}


def targets(report: dict, device: str) -> list[dict]:
    """Each of ``TARGETS`` read from the report's rows (the attention section's default rows, the layer rows):
    {device, name, value, limit, passed}; value and passed None where the row is missing."""
    out = []
    for section, batch, seq, pruned, limit, field in TARGETS:
        rows = [r for r in report[section] if (r["batch"], r["seq"], r["pruned"]) == (batch, seq, pruned)
                and (section == "layer" or r.get("default"))]
        value = rows[0].get(field) if rows else None
        what = f" ({FIELD_NAMES[field]})" if section == "attention" else " (graphed step)"
        name = f"{section} batch {batch} T {seq} pruned {pruned}{what}: ragged/dense <= {limit}"
        out.append({"device": device, "name": name, "value": value, "limit": limit,
                    "passed": None if value is None else value <= limit})
    return out


def print_report(report) -> None:
    """Prints the report (the rows of every section, the replay, the targets, the errors)."""
    source = report["kernel_source"]
    print(f"# {report['device']} — kernel source: {source['origin']} {source['location']} "
          f"(stood in: {', '.join(source['stood_in']) or 'none'})")
    for row in report["exactness"]:
        print(f"exact {row['kernel']:<38} max err {row['max_abs_err']:.2e} (ref {row['max_abs_ref']:.2f}) "
              f"{'ok' if row['passed'] else 'FAILED'}")
    for row in report["attention"]:
        extra = f" {row.get('policy', '')} {row.get('max_kv_splits', '')}".rstrip()
        print(f"attn  b{row['batch']:<3} T{row['seq']:<6} p{row['pruned']:<4} {row['kernel'] + extra:<38} "
              f"{row['time_us']:9.1f} us  x{row['ratio']:.2f} dense  {row['gbps']:7.0f} GB/s"
              + (f"  (kernel alone {row['kernel_only_us']:.1f} us x{row['kernel_only_ratio']:.2f})"
                 if "kernel_only_us" in row else ""))
    for row in report["layer"]:
        print(f"layer b{row['batch']:<3} T{row['seq']:<6} p{row['pruned']:<4} graphed dense ({row.get('dense_baseline')}) "
              f"{row['dense_graph_us']:.0f} us "
              f"ragged {row['ragged_graph_us']:.0f} us x{row['ratio']:.2f}; eager {row['dense_eager_us']:.0f} / "
              f"{row['ragged_eager_us']:.0f} us")
    for row in report.get("parts", []):
        print(f"part  b{row['batch']:<3} T{row['seq']:<6} p{row['pruned']:<4} {row['mode']:<6} {row['part']:<24} "
              f"{row['graph_us']:9.1f} us (graphed, {row['kernel']})")
    if report["replay"]:
        print(f"replay {report['replay']}")
    for target in report["targets"]:
        print(f"target {target['name']}: {target['value']} -> {target['passed']}")
    for error in report["errors"]:
        print(f"ERROR in {error['section']}: {error['error']}")
