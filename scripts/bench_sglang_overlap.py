"""Ragged mode in the SGLang engine with SGLang's overlap scheduler off and on, interleaved rounds.

    python scripts/bench_sglang_overlap.py BUNDLE MODEL --engine-python .venv-sglang/bin/python [--rounds 3] [--out F.json]

The same stream as ``kvzap-export bench --engine sglang`` (its ``StreamBench``: prompts from Python's own
documentation, ``ignore_eos``), every request with KVzap ``decoding``, at a pool of 4 requests' worth; each round runs
overlap off, then on. Prints one line per run and the medians; ``--out`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvzap_export.bench.sglang_stream import StreamBench, run_stream  # noqa: E402
from kvzap_export.bench.stream_figures import run_figures  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("model")
    parser.add_argument("--engine-python", required=True, help="the SGLang environment's Python")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    pool = 4 * (args.prompt_tokens + args.new_tokens)
    bench = StreamBench(args.bundle, args.model, args.engine_python, args.requests, args.prompt_tokens, args.new_tokens,
                        pool, None, 0)
    out = {"settings": {"requests": args.requests, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                        "pool_tokens": pool, "mode": "ragged", "kvzap": "decoding"}, "runs": []}
    for number in range(1, args.rounds + 1):
        for overlap in (False, True):
            result = run_stream(args.engine_python, bench.spec("ragged", overlap=overlap))
            figures = run_figures(result)
            run = {"round": number, "overlap": overlap, "resolved": result["engine"].get("resolved"),
                   "tokens_per_s": figures["tokens_per_s"], "wall_s": figures["wall_s"],
                   "max_running": figures["max_running"], "freed_at_peak": figures["freed_at_peak"]}
            out["runs"].append(run)
            print(f"round {number}, overlap {'on' if overlap else 'off'}: {run['tokens_per_s']:.2f} tokens/s, "
                  f"wall {run['wall_s']:.1f} s, {run['max_running']} running", flush=True)
    for overlap in (False, True):
        key = f"median_tokens_per_s_overlap_{'on' if overlap else 'off'}"
        out[key] = statistics.median(r["tokens_per_s"] for r in out["runs"] if r["overlap"] is overlap)
    out["on_over_off"] = out["median_tokens_per_s_overlap_on"] / out["median_tokens_per_s_overlap_off"]
    print(f"medians: off {out['median_tokens_per_s_overlap_off']:.2f}, on {out['median_tokens_per_s_overlap_on']:.2f} "
          f"tokens/s (on/off {out['on_over_off']:.3f})")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
