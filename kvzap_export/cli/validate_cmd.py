"""``kvzap-export validate``: the parity verdict a CI gate can trust."""

from __future__ import annotations

import json

import click


@click.command()
@click.argument("bundle", type=click.Path())
@click.option("--backends", default="torch,onnxrt", show_default=True,
              help="Comma-separated backends compared with the PyTorch reference: torch, onnxrt, trt "
                   "(trt needs TensorRT, a GPU and engines from `kvzap-export build`).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Device of the PyTorch reference and the model-level run.")
@click.option("--plugin-lib", "plugin_libs", multiple=True, type=click.Path(), metavar="PATH", envvar="KVZAP_TRT_PLUGIN_LIB",
              help="With --backends trt: the compaction plugin's library (libkvzap_trt_plugin.so, `cmake -S plugins -B build`), "
                   "loaded before the plugin-node engine is deserialized (not needed for version-compatible engines). "
                   "Default: $KVZAP_TRT_PLUGIN_LIB.")
@click.option("--model", default=None, metavar="PRESET|PATH",
              help="Model for real hidden states and the model-level check: a local HF model directory, or a preset the "
                   "toolkit ships offline (default: the bundle's preset when it is one, e.g. smollm2-135m).")
@click.option("--no-model-level", is_flag=True, help="Skip the model-level generation check (operator and decision levels only).")
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
@click.option("--quiet", "-q", is_flag=True, help="No progress bars or checklist.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
def validate(bundle, backends, device, plugin_libs, model, no_model_level, engine, engine_mode, engine_python,
             prompts_file, max_new_tokens, quiet, as_json) -> None:
    """Validate a bundle against the PyTorch reference at three levels.

    \b
    1. operator: every artifact vs the reference, on random and real hidden states, shapes that differ
       from the export shapes; max abs/rel error per output (compaction graphs: exact);
    2. decision: keep-mask agreement and unexplained flips (disagreements far from τ);
    3. model: the real model generating with a physically compacted KV cache vs kvpress's masked run
       (stores kvpress's greedy tokens in BUNDLE/report/reference.json);
    4. engine (only with --engine sglang): a real SGLang engine with KVzap attached vs that reference,
       per prompt and KVZAP_DECODING setting, with the KV its allocator held (BUNDLE/report/engine-*.md).
    Writes BUNDLE/report/parity.{json,md} and plots; exits 2 listing the failed checks.
    """
    from kvzap_export.cli.progress import progress_bars
    from kvzap_export.errors import KvzapError
    from kvzap_export.validate.run import parse_backends, validate_bundle

    if engine is not None:
        from kvzap_export.cli.engine_report import run_engine_cli

        run_engine_cli(bundle, engine, engine_mode, model, prompts_file, max_new_tokens, engine_python, device, quiet, as_json)
        return
    chosen = parse_backends(backends)
    with progress_bars(enabled=not (quiet or as_json)) as progress:
        report = validate_bundle(bundle, chosen, device=device, model=model, model_level=not no_model_level, progress=progress,
                                 plugin_libraries=tuple(plugin_libs))
    if as_json:
        click.echo(json.dumps(report, indent=2, default=float))
    elif not quiet:
        from pathlib import Path

        click.echo((Path(bundle) / "report" / "parity.md").read_text(), err=True)
    if not report["passed"]:
        raise KvzapError(f"validation failed: {', '.join(report['failed'])}; see {bundle}/report/parity.md")
