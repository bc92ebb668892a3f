"""``kvzap-export validate``: the parity verdict a CI gate can trust (exit 0 passed, 1 failed, 3 incomplete)."""

from __future__ import annotations

import json

import click

from kvzap_export.cli.engine_args import HELP as ENGINE_ARG_HELP


@click.command()
@click.argument("bundle", type=click.Path())
@click.option("--backends", default=None,
              help="Comma-separated backends compared with the PyTorch reference: torch, onnxrt, trt (TensorRT engines from "
                   "`kvzap-export build`), triton and cuda (the GPU kernels). Default: torch,onnxrt; with --device cuda "
                   "also triton,cuda.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Device of the PyTorch reference (native dtype there), of ONNX Runtime (its CUDA provider when "
                   "onnxruntime-gpu is installed) and of the GPU kernels.")
@click.option("--require", "require", default=None, metavar="LEVELS",
              help="Comma-separated levels that must run (bundle, operator, decision, model, engine; 'all' = all but "
                   "engine): a required level that did not run fails the validation (exit 1) instead of leaving it "
                   "incomplete (exit 3).")
@click.option("--plugin-lib", "plugin_libs", multiple=True, type=click.Path(), metavar="PATH", envvar="KVZAP_TRT_PLUGIN_LIB",
              help="With --backends trt: the compaction plugin's library (libkvzap_trt_plugin.so, `cmake -S plugins -B build`), "
                   "loaded before the plugin-node engine is deserialized (not needed for version-compatible engines). "
                   "Default: $KVZAP_TRT_PLUGIN_LIB.")
@click.option("--cuda-lib", default=None, type=click.Path(), metavar="PATH",
              help="With --device cuda: the CUDA kernel library (libkvzap_kernels.so); default: built with nvcc from plugins/.")
@click.option("--model", default=None, metavar="PRESET|PATH",
              help="Model for real hidden states and the model-level check: a local HF model directory, or a preset the "
                   "toolkit ships offline (default: the bundle's preset when it is one, e.g. smollm2-135m). Without one "
                   "the decision level runs on synthetic hidden states and the model level does not run.")
@click.option("--no-model-level", is_flag=True, help="Skip the model-level generation check (the verdict is then incomplete).")
@click.option("--engine", type=click.Choice(["sglang"]), default=None,
              help="Run only the engine level: a real serving engine with KVzap attached, greedy, vs the kvpress reference "
                   "the bundle carries (report/reference.json, written by the model level). Needs --model DIR.")
@click.option("--engine-mode", type=click.Choice(["mask", "evict", "ragged"]), default="mask", show_default=True,
              help="With --engine: mask (exact, frees nothing), evict (one KV length per request; frees what every "
                   "head of every layer dropped) or ragged (per-head storage: frees each head's evicted entries).")
@click.option("--engine-python", default=None, metavar="PATH", envvar="KVZAP_SGLANG_PYTHON",
              help="With --engine: the Python of the engine's environment (default: $KVZAP_SGLANG_PYTHON, else this "
                   "Python if it has sglang). On a CPU machine: bash scripts/sglang_cpu_env.sh DIR, then DIR/bin/python.")
@click.option("--prompts", "prompts_file", default=None, type=click.Path(), metavar="FILE.json",
              help="With --engine: a JSON list of prompt strings instead of the reference's prompts (reported without a "
                   "verdict unless the reference has their exact token ids).")
@click.option("--max-new-tokens", default=None, type=int, metavar="N",
              help="With --engine: greedy tokens per prompt (default: as many as the reference holds).")
@click.option("--chunk-size", default=None, type=click.IntRange(min=1), metavar="N",
              help="With --engine: SGLang's prefill chunk (--chunked-prefill-size), tokens per chunk; a prompt longer "
                   "than N is prefilled in several chunks and decided at its last (default: SGLang's own size).")
@click.option("--no-radix-cache", is_flag=True,
              help="With --engine: SGLang's radix cache off (ragged mode runs with it on by default, sharing cached "
                   "prompts' entries; mask and evict mode always run with it off). Validates the setting a deployment "
                   "without prefix caching serves with.")
@click.option("--engine-arg", "engine_arg", multiple=True, metavar="KEY=VALUE",
              help="With --engine: " + ENGINE_ARG_HELP + " The engine level sets the model, float32, the prefill chunk "
                   "(--chunk-size) and the radix cache (--no-radix-cache) itself. On a GPU without flashinfer: "
                   "--engine-arg sampling_backend=pytorch.")
@click.option("--tp-size", default=1, show_default=True, type=click.IntRange(min=1), metavar="N",
              help="With --engine: SGLang's tensor parallelism (its --tp-size): N ranks, each holding its share of the KV "
                   "heads (ragged mode: each rank stores and decides its own heads; the readings are every rank's). On "
                   "the CPU engine the ranks split this machine's cores.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars or checklist.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
def validate(bundle, backends, device, require, plugin_libs, cuda_lib, model, no_model_level, engine, engine_mode, engine_python,
             prompts_file, max_new_tokens, chunk_size, no_radix_cache, engine_arg, tp_size, quiet, as_json) -> None:
    """Validate a bundle against the PyTorch reference at three levels.

    \b
    1. operator: every artifact vs the reference, on random and real hidden states, shapes that differ
       from the export shapes; max abs/rel error per output (compaction graphs and kernels: exact);
    2. decision: keep-mask agreement over several sequences, flips counted among the decisions outside
       the window (the ones that can flip);
    3. model: the real model generating with a physically compacted KV cache vs kvpress's masked run
       (stores kvpress's greedy tokens in BUNDLE/report/reference.json);
    4. engine (only with --engine sglang): a real SGLang engine with KVzap attached vs that reference,
       per prompt and KVZAP_DECODING setting, with the KV its allocator held (BUNDLE/report/engine-*.md).
    Writes BUNDLE/report/parity.{json,md} and plots. Exit code: 0 passed (every check ran and passed),
    1 failed, 3 incomplete (nothing failed, something did not run), 2 a usage error.
    """
    from kvzap_export.cli.progress import progress_bars
    from kvzap_export.validate.checks import parse_levels, verdict_error
    from kvzap_export.validate.run import parse_backends, validate_bundle

    from kvzap_export.errors import ConfigError

    levels = parse_levels(require)
    if chunk_size is not None and engine is None:
        raise ConfigError(f"--chunk-size {chunk_size}: it sets the serving engine's prefill chunk; add --engine sglang")
    if no_radix_cache and engine is None:
        raise ConfigError("--no-radix-cache: it turns the serving engine's radix cache off; add --engine sglang")
    if engine_arg and engine is None:
        raise ConfigError(f"--engine-arg {engine_arg[0]}: it sets a serving engine's argument; add --engine sglang")
    if tp_size != 1 and engine is None:
        raise ConfigError(f"--tp-size {tp_size}: it sets the serving engine's tensor parallelism; add --engine sglang")
    if engine is not None:
        from kvzap_export.cli.engine_report import run_engine_cli

        if set(levels) - {"engine"}:
            raise ConfigError(f"--require {require}: with --engine only the engine level runs; require engine, or "
                              "validate the other levels without --engine")
        from kvzap_export.cli.engine_args import parse_engine_args

        extra = parse_engine_args(engine_arg, {"model_path": "--model", "dtype": "the engine level (float32: its reference's)",
                                               "chunked_prefill_size": "--chunk-size",
                                               "disable_radix_cache": "--no-radix-cache", "tp_size": "--tp-size"})
        if tp_size != 1:
            extra["tp_size"] = tp_size
        run_engine_cli(bundle, engine, engine_mode, model, prompts_file, max_new_tokens, engine_python, device, quiet,
                       as_json, levels, chunk_size, radix_cache=not no_radix_cache, extra_engine_args=extra)
        return
    if "engine" in levels:
        raise ConfigError("--require engine: the engine level runs only with --engine sglang --model DIR; add them, "
                          "or leave engine out of --require")
    chosen = parse_backends(backends, device)
    with progress_bars(enabled=not (quiet or as_json)) as progress:
        report = validate_bundle(bundle, chosen, device=device, model=model, model_level=not no_model_level, progress=progress,
                                 plugin_libraries=tuple(plugin_libs), require=levels, cuda_library=cuda_lib)
    if as_json:
        click.echo(json.dumps(report, indent=2, default=float))
    elif not quiet:
        from pathlib import Path

        click.echo((Path(bundle) / "report" / "parity.md").read_text(), err=True)
    error = verdict_error(report, f"{bundle}/report/parity.md")
    if error is not None:
        raise error
