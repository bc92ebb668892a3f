#!/usr/bin/env python
"""GPU benchmark of the compaction kernels — Triton (kvzap_export/kernels/triton_compaction.py) and CUDA C
(plugins/src/compaction.cu through kvzap_export/kernels/cuda_lib.py) — against the torch reference.

    python scripts/bench_kernels.py                        # Llama-3.1-8B shapes: batch 1, 8 KV heads, head dim 128, bf16
    python scripts/bench_kernels.py --seq 4096 131072 --json results.json
    python scripts/bench_kernels.py --check                # exactness of both kernels on this GPU, then exit
    python scripts/bench_kernels.py --cuda-lib build/libkvzap_kernels.so   # a library CMake built (default: nvcc now)
    python scripts/bench_kernels.py --rows 16 32 64 128 --block 1024 2048 --chunk 4096 8192 131072   # sweep Triton tiles

Two benchmarks per sequence length T, for each kernel implementation:

- compaction: the fused kernel's launcher (no input validation, no host sync) vs the reference's
  ``keep_mask`` + ``indices_from_keep`` (also without validation); also the validated public entry point
  (``check_inputs`` reads ``lengths`` back to the host).
- K/V move: the move kernel vs the reference ``kv_compaction`` vs a device-to-device copy of K and V (the
  same output bytes). Effective bandwidth counts the bytes each really touches: the move reads the kept
  rows and the indices and writes every row; the copy reads and writes every row.

Timing: CUDA events around each call, L2 flushed (a 256 MiB write) before each, warm-up calls first,
median of ``--reps``. Targets (printed, informational): K/V move ≥ 80% of copy bandwidth, fused compaction
≥ 5× faster than the reference at the longest T. The CUDA library is built with nvcc into a temporary
directory unless ``--cuda-lib`` names one; without nvcc the CUDA rows are skipped with a line saying so.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEVICE = "cuda"
MOVE_TARGET = 0.80
SPEEDUP_TARGET = 5.0
# --check also runs these (batch, heads, seq, head_dim): several sequences, odd head dims, rows not 16-byte sized
ODD_SHAPES = ((3, 2, 1000, 24), (2, 3, 5000, 64), (2, 2, 333, 3))


def _timer(torch, flush, warmup: int, reps: int):
    """Median seconds per call, CUDA events, L2 flushed before each (``bench.timing.flushed_timer``; ``torch`` is
    passed so that tests can stand a wall clock in)."""
    from kvzap_export.bench.timing import flushed_timer

    return flushed_timer(flush, warmup, reps)


def _inputs(torch, batch: int, heads: int, seq: int, head_dim: int, dtype, seed: int = 0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    scores = torch.randn(batch, heads, seq, device=DEVICE, generator=gen).to(dtype)
    scores[..., ::97] = float("nan")  # kept (strict <)
    lengths = torch.full((batch,), seq, dtype=torch.int32, device=DEVICE)
    keys = torch.randn(batch, heads, seq, head_dim, device=DEVICE, generator=gen).to(dtype)
    values = torch.randn(batch, heads, seq, head_dim, device=DEVICE, generator=gen).to(dtype)
    return scores, lengths, keys, values


def bench(args, cuda=None) -> list[dict]:
    """Rows of timings; ``cuda``: a ``CudaKernels`` or None (Triton only)."""
    import torch

    from kvzap_export.export.dtypes import TORCH_DTYPES
    from kvzap_export.kernels import triton_compaction as tk
    from kvzap_export.ops.compaction import indices_from_keep, keep_mask, kv_compaction

    dtype = TORCH_DTYPES[args.dtype]
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
    measure = _timer(torch, flush, args.warmup, args.reps)
    rows = []
    for seq in args.seq:
        scores, lengths, keys, values = _inputs(torch, args.batch, args.heads, seq, args.head_dim, dtype)
        tau, window = args.threshold, args.window
        ref_s = measure(lambda: indices_from_keep(keep_mask(scores, lengths, tau, window, 0)))

        def compaction_row(impl, config, kernel_s, validated_s):
            return {"benchmark": "compaction", "impl": impl, "seq": seq, "config": config, "kernel_us": kernel_s * 1e6,
                    "validated_us": validated_s * 1e6, "torch_reference_us": ref_s * 1e6, "speedup": ref_s / kernel_s}

        public_s = measure(lambda: tk.triton_threshold_compaction(scores, lengths, tau, window))
        for block in args.block or [None]:
            for chunk in args.chunk or [None]:
                config = tk.compaction_config(seq, block, chunk)
                kernel_s = measure(lambda c=config: tk.launch_threshold_compaction(
                    scores, lengths, tau, window, 0, block=c.block, chunk=c.chunk))
                rows.append(compaction_row("triton", f"block {config.block}, chunk {config.chunk}, "
                                           f"{config.programs(args.batch, args.heads, seq)} programs", kernel_s, public_s))
        if cuda is not None:
            tau_t = torch.tensor(tau, dtype=torch.float32, device=DEVICE)
            win_t = torch.tensor(window, dtype=torch.int32, device=DEVICE)
            kernel_s = measure(lambda: cuda.launch_threshold_compaction(scores, lengths, tau_t, win_t))
            validated_s = measure(lambda: cuda.threshold_compaction(scores, lengths, tau, window))
            blocks, span = cuda.threshold_compaction_grid(args.batch, args.heads, seq)
            rows.append(compaction_row("cuda", f"{blocks} blocks of {span} positions", kernel_s, validated_s))

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

        def move_row(impl, config, move_s):
            move_gbps = move_bytes / move_s / 1e9
            return {"benchmark": "kv_move", "impl": impl, "seq": seq, "config": config, "kept_fraction": kept / total_rows,
                    "kernel_us": move_s * 1e6, "torch_reference_us": ref_move_s * 1e6, "copy_us": copy_s * 1e6,
                    "kernel_GBps": move_gbps, "torch_reference_GBps": move_bytes / ref_move_s / 1e9, "copy_GBps": copy_gbps,
                    "pct_of_copy_bandwidth": 100 * move_gbps / copy_gbps, "speedup_vs_reference": ref_move_s / move_s}

        for r in args.rows or [None]:
            move_s = measure(lambda r=r: tk.launch_kv_compaction(keys, values, result.indices, rows=r))
            rows.append(move_row("triton", f"{r or tk.move_rows_per_program(args.head_dim, elem)} rows/program", move_s))
        if cuda is not None:
            out = (keys_out, values_out)
            move_s = measure(lambda: cuda.launch_kv_compaction(keys, values, result.indices, out=out))
            rows.append(move_row("cuda", "16-byte vectors" if row_bytes % 16 == 0 else "scalar rows", move_s))
        del scores, lengths, keys, values, keys_out, values_out, result
        torch.cuda.empty_cache()
    return rows


def check(args, cuda=None) -> bool:
    """Both kernels vs the reference (CPU and CUDA) at the benchmark shapes and small odd ones; True if all exact."""
    import torch

    from kvzap_export.kernels import triton_compaction as tk
    from kvzap_export.ops.compaction import kv_compaction, threshold_compaction

    ok = True

    def same(label, got, want) -> None:
        nonlocal ok
        equal = all(torch.equal(g.cpu(), w.cpu()) for g, w in zip(got, want))
        ok &= equal
        if not equal:
            print(f"MISMATCH {label}")

    shapes = [(args.batch, args.heads, seq, args.head_dim) for seq in args.seq] + list(ODD_SHAPES)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for batch, heads, seq, head_dim in shapes:
            scores, _, keys, values = _inputs(torch, batch, heads, seq, head_dim, dtype, seed=seq)
            lengths = torch.randint(0, seq + 1, (batch,), device=DEVICE, dtype=torch.int32)
            lengths[0] = seq
            for tau, window, sink in ((args.threshold, args.window, 0), (0.37, 7, 4), (-1.0, 0, 0)):
                case = f"{dtype} {(batch, heads, seq, head_dim)} tau={tau} window={window} sink={sink}"
                ref = threshold_compaction(scores.cpu(), lengths.cpu(), tau, window, sink)
                same(f"compaction vs cuda-device reference {case}", threshold_compaction(scores, lengths, tau, window, sink), ref)
                same(f"triton compaction {case}", tk.triton_threshold_compaction(scores, lengths, tau, window, sink), ref)
                for block, chunk in ((64, 256), (None, 1 << 30)):  # many programs per row; one program per row
                    same(f"triton compaction tiles block={block} chunk={chunk} {case}",
                         tk.launch_threshold_compaction(scores, lengths, tau, window, sink, block=block, chunk=chunk), ref)
                ref_kv = kv_compaction(keys, values, ref.indices.to(DEVICE))
                same(f"triton kv_move {case}", tk.triton_kv_compaction(keys, values, ref.indices.to(DEVICE)), ref_kv)
                if cuda is not None:
                    for keep_dtype in (torch.bool, torch.int32):
                        got = cuda.threshold_compaction(scores, lengths, tau, window, sink, keep_dtype=keep_dtype)
                        same(f"cuda compaction keep={keep_dtype} {case}", (got.keep.bool(), got.counts, got.indices), ref)
                    same(f"cuda kv_move {case}", cuda.kv_compaction(keys, values, ref.indices.to(DEVICE)), ref_kv)
    print(f"check: {_kernels(cuda)} {'exactly equal the reference' if ok else ': MISMATCHES found'} on {_device_name(torch)}")
    return ok


def _kernels(cuda) -> str:
    """What was compared, by name: the CUDA rows come from the library at ``cuda.path``."""
    return f"the Triton kernels and the CUDA kernels of {cuda.path}" if cuda is not None else \
        "the Triton kernels (CUDA library not loaded)"


def _device_name(torch) -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE


def _table(rows: list[dict]) -> str:
    lines = []
    comp = [r for r in rows if r["benchmark"] == "compaction"]
    if comp:
        lines += ["| T | kernel | configuration | fused kernel µs | validated entry µs | torch reference µs | speedup |",
                  "|---:|---|---|---:|---:|---:|---:|"]
        lines += [f"| {r['seq']} | {r['impl']} | {r['config']} | {r['kernel_us']:.1f} | {r['validated_us']:.1f} | "
                  f"{r['torch_reference_us']:.1f} | {r['speedup']:.1f}× |" for r in comp]
    move = [r for r in rows if r["benchmark"] == "kv_move"]
    if move:
        lines += ["", "| T | kernel | configuration | kept | move kernel µs (GB/s) | torch reference µs (GB/s) | D2D copy µs (GB/s) | % of copy BW |",
                  "|---:|---|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['seq']} | {r['impl']} | {r['config']} | {100 * r['kept_fraction']:.0f}% | {r['kernel_us']:.1f} "
                  f"({r['kernel_GBps']:.0f}) | {r['torch_reference_us']:.1f} ({r['torch_reference_GBps']:.0f}) | "
                  f"{r['copy_us']:.1f} ({r['copy_GBps']:.0f}) | {r['pct_of_copy_bandwidth']:.0f}% |" for r in move]
    return "\n".join(lines)


def _targets(rows: list[dict]) -> list[str]:
    longest = max(r["seq"] for r in rows)
    out = []
    for impl in sorted({r["impl"] for r in rows}, reverse=True):  # triton, then cuda
        at = [r for r in rows if r["impl"] == impl and r["seq"] == longest]
        comp = max((r for r in at if r["benchmark"] == "compaction"), key=lambda r: r["speedup"])
        move = max((r for r in at if r["benchmark"] == "kv_move"), key=lambda r: r["pct_of_copy_bandwidth"])
        out += [f"target {impl} fused compaction >= {SPEEDUP_TARGET:.0f}x reference at T={longest}: {comp['speedup']:.1f}x "
                f"({'met' if comp['speedup'] >= SPEEDUP_TARGET else 'MISSED'})",
                f"target {impl} K/V move >= {100 * MOVE_TARGET:.0f}% of copy bandwidth at T={longest}: "
                f"{move['pct_of_copy_bandwidth']:.0f}% ({'met' if move['pct_of_copy_bandwidth'] >= 100 * MOVE_TARGET else 'MISSED'})"]
    return out


def _cuda_kernels(args, scratch: Path):
    """The CUDA library: --cuda-lib, else built with nvcc into ``scratch``; None (with a printed line) if it cannot be."""
    from kvzap_export.errors import KvzapError
    from kvzap_export.kernels.cuda_lib import CudaKernels, build_kernel_library

    if args.no_cuda:
        return None
    try:
        if args.cuda_lib is not None:
            return CudaKernels(args.cuda_lib)
        print("bench_kernels: building the CUDA kernels with nvcc (sm_80 and sm_90, PTX of sm_90) ...", flush=True)
        return CudaKernels(build_kernel_library(scratch / "libkvzap_kernels.so"))
    except KvzapError as error:
        print(f"bench_kernels: CUDA kernels skipped: {error}")
        return None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    parser.add_argument("--cuda-lib", type=Path, help="a built libkvzap_kernels.so (default: build one with nvcc now)")
    parser.add_argument("--no-cuda", action="store_true", help="Triton kernels only")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    try:
        import torch
    except ModuleNotFoundError:
        print("bench_kernels: needs torch (and a CUDA GPU); torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU; none is visible to torch on this machine", file=sys.stderr)
        return 2
    from kvzap_export.errors import KvzapError
    from kvzap_export.kernels import triton_compaction as tk

    try:
        tk.require_triton()
    except KvzapError as error:
        print(f"bench_kernels: {error}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvzap-bench-") as scratch:
        cuda = _cuda_kernels(args, Path(scratch))
        if args.check:
            return 0 if check(args, cuda) else 1
        rows = bench(args, cuda)
    device = _device_name(torch)
    print(f"# {_kernels(cuda)} vs torch reference — {device}, batch {args.batch}, {args.heads} KV heads, "
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
