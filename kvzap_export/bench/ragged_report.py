"""The console report of ``scripts/bench_ragged_decode.py``: one line per row of its JSON report."""

from __future__ import annotations


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
