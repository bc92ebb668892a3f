"""Options shared by the bare pipeline command and ``kvzap-export export``."""

from __future__ import annotations

import click

PIPELINE_OPTIONS = [
    click.option("--model", "-m", default=None, metavar="PRESET|PATH",
                 help="Model preset (see `kvzap-export presets`), a preset YAML, a local HF model directory or its config.json."),
    click.option("--out", "-o", default=None, type=click.Path(), metavar="DIR",
                 help="Bundle directory to write (atomically: an existing bundle is replaced only on success)."),
    click.option("--variant", type=click.Choice(["linear", "mlp"]), default=None,
                 help="Surrogate variant: which shipped or hub checkpoint to take (default: the preset's, mlp). With "
                      "--weights the checkpoint's own variant is used; a --variant that contradicts it is an error."),
    click.option("--weights", default=None, metavar="DIR",
                 help="kvpress-format surrogate checkpoint directory (config.json + model.safetensors). "
                      "Default: the copy shipped with the preset, else the hub id from the local Hugging Face cache."),
    click.option("--dtype", default="float32", show_default=True, metavar="float32|float16|bfloat16",
                 help="Activation dtype of the exported graphs; weights are cast to it, as kvpress does."),
    click.option("--opset", default=20, show_default=True, type=int, help="ONNX opset (18-20)."),
    click.option("--threshold", default=None, type=float, help="Pruning threshold τ on log-scores. Default: the preset's."),
    click.option("--window", default=None, type=int, help="Most recent tokens always kept. Default: the preset's (128)."),
    click.option("--sink", default=None, type=int, help="First tokens always kept (our extension; 0 = kvpress semantics)."),
    click.option("--max-tokens", default=8192, show_default=True, type=int,
                 help="Largest token count per surrogate call that TensorRT profiles will cover."),
    click.option("--require-trt", is_flag=True,
                 help="Fail (exit 2) unless TensorRT and a GPU are present to build engines; by default the build "
                      "stage is skipped with a one-line status and the manifest records tensorrt: null."),
    click.option("--no-validate", is_flag=True,
                 help="Skip the validation stage (then run `kvzap-export validate DIR` yourself); the manifest's verdict "
                      "is then 'incomplete' and the command exits 0."),
    click.option("--require", default=None, metavar="LEVELS",
                 help="Validation levels that must run (bundle, operator, decision, model; 'all'): if one does not, the "
                      "validation fails and nothing is written. Otherwise a bundle some of whose checks could not run is "
                      "written with the verdict 'incomplete' (exit 3)."),
    click.option("--validate-model", default=None, metavar="PRESET|PATH",
                 help="Model used by the validation stage for real hidden states and generation (default: the preset's "
                      "own when the toolkit ships it offline)."),
    click.option("--force", is_flag=True, help="Replace a non-empty --out."),
    click.option("--quiet", "-q", is_flag=True, help="No progress bars or summary table."),
    click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary as JSON on stdout."),
]


def pipeline_options(func):
    for option in reversed(PIPELINE_OPTIONS):
        func = option(func)
    return func
