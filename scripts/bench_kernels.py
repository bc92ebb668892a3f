#!/usr/bin/env python
"""GPU benchmark of the Triton kernels (kvzap_export/kernels/triton_compaction.py) against the torch reference.

    python scripts/bench_kernels.py                        # Llama-3.1-8B shapes: batch 1, 8 KV heads, head dim 128, bf16
    python scripts/bench_kernels.py --seq 4096 131072 --json results.json
    python scripts/bench_kernels.py --check                # exactness of the kernels on this GPU, then exit
    python scripts/bench_kernels.py --rows 16 32 64 128 --block 1024 2048 --chunk 4096 8192 131072   # sweep tiles

Two benchmarks per sequence length T:

- compaction: the fused kernel (``launch_threshold_compaction``: no input validation, no host sync) vs the
  reference's ``keep_mask`` + ``indices_from_keep`` (also without validation); also the validated public
  ``triton_threshold_compaction`` (``check_inputs`` reads ``lengths`` back to the host).
- K/V move: the move kernel vs the reference ``kv_compaction`` vs a device-to-device copy of K and V (the
  same output bytes). Effective bandwidth counts the bytes each really touches: the move reads the kept
  rows and the indices and writes every row; the copy reads and writes every row.

Timing: CUDA events around each call, L2 flushed (a 256 MiB write) before each, warm-up calls first,
median of ``--reps``. Targets (printed, informational): K/V move ≥ 80% of copy bandwidth, fused compaction
≥ 5× faster than the reference at the longest T.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEVICE = "cuda"
MOVE_TARGET = 0.80
SPEEDUP_TARGET = 5.0


def _timer(torch, flush, warmup: int, reps: int):
    def measure(fn) -> float:
        """Median seconds of ``fn()`` on the current stream."""
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    return measure


def _inputs(torch, batch: int, heads: int, seq: int, head_dim: int, dtype, seed: int = 0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    scores = torch.randn(batch, heads, seq, device=DEVICE, generator=gen).to(dtype)
    scores[..., ::97] = float("nan")  # kept (strict <)
    lengths = torch.full((batch,), seq, dtype=torch.int32, device=DEVICE)
    keys = torch.randn(batch, heads, seq, head_dim, device=DEVICE, generator=gen).to(dtype)
    values = torch.randn(batch, heads, seq, head_dim, device=DEVICE, generator=gen).to(dtype)
    return scores, lengths, keys, values


def bench(args) -> list[dict]:
    import torch

    from kvzap_export.kernels import triton_compaction as tk
    from kvzap_export.ops.compaction import indices_from_keep, keep_mask, kv_compaction

    dtype = getattr(torch, args.dtype)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
    measure = _timer(torch, flush, args.warmup, args.reps)
    rows = []
    for seq in args.seq:
        scores, lengths, keys, values = _inputs(torch, args.batch, args.heads, seq, args.head_dim, dtype)
        tau, window = args.threshold, args.window

        def reference():
            return indices_from_keep(keep_mask(scores, lengths, tau, window, 0))

        ref_s = measure(reference)
        public_s = measure(lambda: tk.triton_threshold_compaction(scores, lengths, tau, window))
        for block in args.block or [None]:
            for chunk in args.chunk or [None]:
                config = tk.compaction_config(seq, block, chunk)
                kernel_s = measure(lambda c=config: tk.launch_threshold_compaction(
                    scores, lengths, tau, window, 0, block=c.block, chunk=c.chunk))
                rows.append({"benchmark": "compaction", "seq": seq, "block": config.block, "chunk": config.chunk,
                             "programs": config.programs(args.batch, args.heads, seq),
                             "triton_us": kernel_s * 1e6, "triton_validated_us": public_s * 1e6,
                             "torch_reference_us": ref_s * 1e6, "speedup": ref_s / kernel_s})

        result = tk.launch_threshold_compaction(scores, lengths, tau, window)
        kept = int(result.counts.sum())
        elem = keys.element_size()
        row_bytes = args.head_dim * elem
        total_rows = keys.shape[0] * keys.shape[1] * seq
        move_bytes = 2 * (kept * row_bytes + total_rows * row_bytes) + total_rows * 4  # K and V, + indices
        copy_bytes = 2 * 2 * total_rows * row_bytes  # K and V, read + write
        keys_out, values_out = torch.empty_like(keys), torch.empty_like(values)

        def copy():
            keys_out.copy_(keys)
            values_out.copy_(values)

        copy_s = measure(copy)
        ref_move_s = measure(lambda: kv_compaction(keys, values, result.indices))
        copy_gbps = copy_bytes / copy_s / 1e9
        for r in args.rows or [None]:
            move_s = measure(lambda r=r: tk.launch_kv_compaction(keys, values, result.indices, rows=r))
            move_gbps = move_bytes / move_s / 1e9
            rows.append({"benchmark": "kv_move", "seq": seq, "rows": r or tk.move_rows_per_program(args.head_dim, elem),
                         "kept_fraction": kept / total_rows, "triton_us": move_s * 1e6, "torch_reference_us": ref_move_s * 1e6,
                         "copy_us": copy_s * 1e6, "triton_GBps": move_gbps,
                         "torch_reference_GBps": move_bytes / ref_move_s / 1e9, "copy_GBps": copy_gbps,
                         "pct_of_copy_bandwidth": 100 * move_gbps / copy_gbps, "speedup_vs_reference": ref_move_s / move_s})
        del scores, lengths, keys, values, keys_out, values_out, result
        torch.cuda.empty_cache()
    return rows


def check(args) -> bool:
    """Kernels vs the reference (CPU and CUDA) at the benchmark shapes and small odd ones; True if all exact."""
    import torch

    from kvzap_export.kernels import triton_compaction as tk
    from kvzap_export.ops.compaction import kv_compaction, threshold_compaction

    ok = True
    shapes = [(args.batch, args.heads, seq, args.head_dim) for seq in args.seq] + [(3, 2, 1000, 24), (2, 3, 5000, 64)]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for batch, heads, seq, head_dim in shapes:
            scores, _, keys, values = _inputs(torch, batch, heads, seq, head_dim, dtype, seed=seq)
            lengths = torch.randint(0, seq + 1, (batch,), device=DEVICE, dtype=torch.int32)
            lengths[0] = seq
            for tau, window, sink in ((args.threshold, args.window, 0), (0.37, 7, 4), (-1.0, 0, 0)):
                got = tk.triton_threshold_compaction(scores, lengths, tau, window, sink)
                for block, chunk in ((64, 256), (None, 1 << 30)):  # many programs per row; one program per row
                    same = all(torch.equal(a, b) for a, b in zip(
                        tk.launch_threshold_compaction(scores, lengths, tau, window, sink, block=block, chunk=chunk), got))
                    ok &= same
                    if not same:
                        print(f"MISMATCH compaction tiles block={block} chunk={chunk} {dtype} {(batch, heads, seq)}")
                for where in ("cpu", DEVICE):
                    ref = threshold_compaction(scores.to(where), lengths.to(where), tau, window, sink)
                    same = all(torch.equal(g.cpu(), r.cpu()) for g, r in zip(got, ref))
                    ok &= same
                    if not same:
                        print(f"MISMATCH compaction {dtype} {(batch, heads, seq)} tau={tau} window={window} sink={sink} vs {where} reference")
                moved = tk.triton_kv_compaction(keys, values, got.indices)
                ref_kv = kv_compaction(keys, values, got.indices)
                same = all(torch.equal(g, r) for g, r in zip(moved, ref_kv))
                ok &= same
                if not same:
                    print(f"MISMATCH kv_move {dtype} {(batch, heads, seq, head_dim)} tau={tau}")
    print(f"check: {'all kernels exactly equal the reference' if ok else 'MISMATCHES found'} on {torch.cuda.get_device_name()}")
    return ok


def _table(rows: list[dict]) -> str:
    lines = []
    comp = [r for r in rows if r["benchmark"] == "compaction"]
    if comp:
        lines += ["| T | block | chunk | programs | fused kernel µs | validated launcher µs | torch reference µs | speedup |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['seq']} | {r['block']} | {r['chunk']} | {r['programs']} | {r['triton_us']:.1f} | "
                  f"{r['triton_validated_us']:.1f} | {r['torch_reference_us']:.1f} | {r['speedup']:.1f}× |" for r in comp]
    move = [r for r in rows if r["benchmark"] == "kv_move"]
    if move:
        lines += ["", "| T | rows/program | kept | move kernel µs (GB/s) | torch reference µs (GB/s) | D2D copy µs (GB/s) | % of copy BW |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['seq']} | {r['rows']} | {100 * r['kept_fraction']:.0f}% | {r['triton_us']:.1f} ({r['triton_GBps']:.0f}) | "
                  f"{r['torch_reference_us']:.1f} ({r['torch_reference_GBps']:.0f}) | {r['copy_us']:.1f} ({r['copy_GBps']:.0f}) | "
                  f"{r['pct_of_copy_bandwidth']:.0f}% |" for r in move]
    return "\n".join(lines)


def _targets(rows: list[dict]) -> list[str]:
    longest = max(r["seq"] for r in rows)
    best_comp = max((r for r in rows if r["benchmark"] == "compaction" and r["seq"] == longest), key=lambda r: r["speedup"])
    best_move = max((r for r in rows if r["benchmark"] == "kv_move" and r["seq"] == longest), key=lambda r: r["pct_of_copy_bandwidth"])
    return [
        f"target fused compaction >= {SPEEDUP_TARGET:.0f}x reference at T={longest}: {best_comp['speedup']:.1f}x "
        f"({'met' if best_comp['speedup'] >= SPEEDUP_TARGET else 'MISSED'})",
        f"target K/V move >= {100 * MOVE_TARGET:.0f}% of copy bandwidth at T={longest}: {best_move['pct_of_copy_bandwidth']:.0f}% "
        f"({'met' if best_move['pct_of_copy_bandwidth'] >= 100 * MOVE_TARGET else 'MISSED'})",
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8, help="KV heads (Llama-3.1-8B: 8)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--threshold", type=float, default=0.0, help="τ; scores are N(0, 1), so 0.0 keeps about half")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--rows", type=int, nargs="*", help="K/V-move rows per program to sweep (powers of two)")
    parser.add_argument("--block", type=int, nargs="*", help="compaction tokens per step to sweep (powers of two)")
    parser.add_argument("--chunk", type=int, nargs="*",
                        help="compaction tokens per program to sweep (powers of two; >= T gives one program per row)")
    parser.add_argument("--json", type=Path, help="also write the rows (and device, versions) to this JSON file")
    parser.add_argument("--check", action="store_true", help="verify exactness on the GPU instead of timing")
    args = parser.parse_args(argv)

    try:
        import torch
    except ModuleNotFoundError:
        print("bench_kernels: needs torch (and a CUDA GPU); torch is not installed")
        return 2
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU; none is visible to torch on this machine")
        return 2
    from kvzap_export.errors import KvzapError
    from kvzap_export.kernels import triton_compaction as tk

    try:
        tk.require_triton()
    except KvzapError as error:
        print(f"bench_kernels: {error}")
        return 2
    if args.check:
        return 0 if check(args) else 1

    rows = bench(args)
    device = torch.cuda.get_device_name()
    print(f"# Triton kernels vs torch reference — {device}, batch {args.batch}, {args.heads} KV heads, "
          f"head dim {args.head_dim}, {args.dtype}, τ={args.threshold}, window={args.window}; median of {args.reps}")
    print(_table(rows))
    print()
    for line in _targets(rows):
        print(line)
    if args.json:
        import triton

        meta = {"device": device, "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows, "targets": _targets(rows)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
