"""Prepares ``.gpu/engine-check/``: what the SGLang steps of ``scripts/gpu_check.sh`` run on a GPU machine that has no
network, beside ``.gpu/engine`` (SGLang itself: build_engine.py). Run it here, in the main environment (kvpress
computes the reference tokens):

    python scripts/sglang_gpu/prepare_engine_check.py [--out .gpu/engine-check] [--limit-mb 8]

Writes (engine_check/layout.py has the layout): two tiny float32 models with seeded random weights and a byte-level
vocabulary (``export-model tiny-llama|tiny-qwen3 --byte-vocab``: Llama and Qwen3 attention, a linear and an MLP
surrogate), each with a bundle at τ = 0 whose report holds kvpress's greedy tokens (the model level of ``validate``,
computed here on the CPU: what SGLang's tokens on the GPU are compared with); a Llama-3.1-8B-shaped config directory
(no weights: SGLang builds the model with ``--load-format dummy``); the plugin's entry point for a checkout on
PYTHONPATH; ``manifest.json``. Prints each part's size; the folder is built beside ``--out`` and moved there at the
end (a failed run leaves an earlier folder as it was); an error is one line, exit 1.

On the GPU machine, gpu_check.sh builds the dummy-weights bundle for the Llama-3.1-8B shapes (6 MB: not carried) with

    python scripts/sglang_gpu/prepare_engine_check.py --dummy-bundle DEST [--config DIR] [--seed 0]

(a seeded random linear surrogate, bfloat16, exported without validation; a few seconds, no kvpress needed).

A maintenance tool of this repository (issue 57), not part of the ``kvzap_export`` package.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from engine_check import layout  # noqa: E402


def say(message: str) -> None:
    print(f"[prepare_engine_check] {message}", flush=True)


def git_commit() -> str:
    from kvzap_export.provenance import checkout_commit

    return checkout_commit(REPO) or "unknown"


def prepare(out: Path, limit: int, seed: int = 0) -> dict:
    from engine_check import build
    from transformers.utils import logging as hf_logging

    from kvzap_export import __version__

    hf_logging.disable_progress_bar()  # its bars would interleave with the steps' lines

    staging = out.with_name(out.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        models = {}
        for number, name in enumerate(layout.TINY_MODELS, 1):
            say(f"{number}/4 {name}: model, bundle at τ = {layout.THRESHOLD:g}, kvpress's reference "
                f"({layout.PROMPTS} prompts x {layout.NEW_TOKENS} tokens, on the CPU)")
            models[name] = build.tiny_model_and_bundle(name, staging / name, seed)
            say(f"    {models[name]['model_level']}")
        layout.write_config_dir(staging / layout.LLAMA_8B)
        points = layout.plugin_entry_points(REPO / "pyproject.toml")
        layout.write_files(staging / layout.PLUGIN_DIR, layout.plugin_dist_files("kvzap-export", __version__, points))
        say(f"3/4 {layout.LLAMA_8B}: Llama-3.1-8B's config (no weights); the plugin's entry point {points}")
        manifest = {
            "schema_version": 1, "built_by": "scripts/sglang_gpu/prepare_engine_check.py",
            "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "kvzap_export_commit": git_commit(), "models": models,
            "llama_8b": {"config": layout.LLAMA_8B, "load_format": "dummy",
                         "bundle": "built on the GPU machine: prepare_engine_check.py --dummy-bundle DEST "
                                   f"--config {layout.LLAMA_8B} (seeded random linear surrogate, bfloat16, not validated)"},
            "plugin": layout.PLUGIN_DIR, "limit_bytes": limit}
        parts = layout.sizes(staging)
        manifest["sizes"], manifest["total_bytes"] = parts, sum(parts.values())  # every file but manifest.json
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        parts["manifest.json"] = (staging / "manifest.json").stat().st_size
        total = sum(parts.values())
        layout.check_limit(total, limit)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    say("4/4 sizes: " + ", ".join(f"{name} {size / 1e6:.2f} MB" for name, size in parts.items()))
    say(f"{out}: {total / 1e6:.2f} MB (limit {limit / 1e6:.1f} MB)")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / ".gpu" / "engine-check")
    parser.add_argument("--limit-mb", type=float, default=8.0, help="fail above this size, in MB of 10^6 bytes")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and surrogates")
    parser.add_argument("--dummy-bundle", type=Path, default=None, metavar="DEST",
                        help="only build the dummy-weights bundle at DEST (gpu_check.sh, on the GPU machine)")
    parser.add_argument("--config", type=Path, default=None, metavar="DIR",
                        help="with --dummy-bundle: the model's config directory (default: OUT/llama-3.1-8b)")
    args = parser.parse_args(argv)
    try:
        if args.dummy_bundle is not None:
            from engine_check import build

            config = args.config or args.out / layout.LLAMA_8B
            if not (config / "config.json").is_file():
                raise ValueError(f"--config {config}: no config.json there (run this script without --dummy-bundle first)")
            manifest = build.dummy_bundle(config.resolve(), args.dummy_bundle.resolve(), args.seed)
            size = sum(p.stat().st_size for p in args.dummy_bundle.rglob("*") if p.is_file())
            say(f"dummy-weights bundle for {config}: {manifest['model']['num_layers']} layers, hidden "
                f"{manifest['model']['hidden_size']}, {manifest['surrogate']['variant']} surrogate, {manifest['dtype']}, "
                f"{size / 1e6:.1f} MB at {args.dummy_bundle}")
        else:
            prepare(args.out.resolve(), int(args.limit_mb * 1e6), args.seed)
    except Exception as error:  # one line: what failed, not a traceback
        text = " ".join(str(error).split()) or type(error).__name__
        print(f"prepare_engine_check: error: {text}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
