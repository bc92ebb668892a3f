"""``kvzap-export build``: TensorRT engines for a bundle."""

from __future__ import annotations

import json

import click


@click.command()
@click.argument("bundle", type=click.Path())
@click.option("--require-trt", is_flag=True,
              help="Exit 2 when TensorRT or a GPU is missing (default: print one status line, leave the bundle unchanged, exit 0).")
@click.option("--plugin-lib", "plugin_libs", multiple=True, type=click.Path(), metavar="PATH",
              help="TensorRT plugin library to load: libkvzap_trt_plugin.so built from plugins/ with CMake. Needed for "
                   "the plugin-node artifact, which is skipped (with the reason recorded) without it or "
                   "--python-plugin. Repeatable.")
@click.option("--python-plugin", is_flag=True,
              help="Build the plugin-node artifact with the Python AOT plugin instead of a library: the Triton kernel "
                   "compiled to PTX (sm_80, compiled forward on newer GPUs) and carried by the engine. Needs, where the "
                   "engine is built, Triton and a TensorRT whose tensorrt.plugin has AOT implementations (11.x); "
                   "nothing where it runs.")
@click.option("--timing-cache", type=click.Path(dir_okay=False), default=None, metavar="PATH",
              help="Persistent timing cache, read if present and updated (default: BUNDLE/engines/timing.cache).")
@click.option("--hardware-compat", type=click.Choice(["none", "ampere+", "same"]), default="none", show_default=True,
              help="Engines that also run on other GPUs: any Ampere-or-newer GPU (ampere+), or any GPU with this "
                   "GPU's compute capability (same). Slightly slower engines.")
@click.option("--version-compatible", is_flag=True,
              help="Engines that later TensorRT versions can run (the plugin library is serialized into the engine).")
@click.option("--workspace-gib", type=click.FloatRange(min=0.0625), default=4.0, show_default=True,
              help="Builder workspace memory limit, GiB.")
@click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True,
              help="Largest batch the compaction engines' optimization profiles cover.")
@click.option("--max-seq", type=click.IntRange(min=1), default=None,
              help="Largest sequence the compaction engines cover. Default: the bundle's max_tokens, capped by the "
                   "model's context length.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def build(bundle, require_trt, plugin_libs, python_plugin, timing_cache, hardware_compat, version_compatible, workspace_gib, max_batch,
          max_seq, as_json) -> None:
    """Build one TensorRT engine per ONNX artifact of BUNDLE and record them in its manifest.

    \b
    Strongly typed networks (precision comes from the ONNX types, as TensorRT 11 requires), one optimization
    profile per engine up to the bundle's max_tokens, a persistent timing cache. The bundle is rewritten
    atomically: engines/*.plan, manifest `engines` section, tools.tensorrt, sha256s.
    Needs `tensorrt` importable and a CUDA GPU.

    \b
    Examples:
      kvzap-export build engine/
      kvzap-export build engine/ --plugin-lib build/libkvzap_trt_plugin.so --hardware-compat ampere+
      kvzap-export build engine/ --python-plugin          # the plugin node without building plugins/
      kvzap-export build engine/ --require-trt --timing-cache ~/.cache/kvzap/timing.cache     # CI
    """
    from kvzap_export.trt.builder import BuildOptions, build_engines

    options = BuildOptions(require_trt=require_trt, plugin_libraries=tuple(plugin_libs), python_plugin=python_plugin,
                           timing_cache=timing_cache,
                           hardware_compat=hardware_compat, version_compatible=version_compatible,
                           workspace_gib=workspace_gib, max_batch=max_batch, max_seq=max_seq)
    result = build_engines(bundle, options)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"{bundle}: {result['status']}", err=True)
    for skipped in result.get("skipped", []):
        click.echo(f"  skipped {skipped['source']}: {skipped['reason']}", err=True)
