"""``kvzap-export build``: TensorRT engines for a bundle."""

from __future__ import annotations

import json

import click


@click.command()
@click.argument("bundle", type=click.Path())
@click.option("--require-trt", is_flag=True, help="Exit 2 when TensorRT or a GPU is missing (default: say so and exit 0).")
@click.option("--plugin-lib", "plugin_libs", multiple=True, type=click.Path(), metavar="PATH",
              help="TensorRT plugin library to load (libkvzap_trt_plugin.so from plugins/); needed for the plugin-node artifact.")
@click.option("--timing-cache", type=click.Path(), default=None, metavar="PATH",
              help="Persistent timing cache, read and updated (default: BUNDLE/engines/timing.cache).")
@click.option("--hardware-compat", type=click.Choice(["none", "ampere+", "same-cc"]), default="none", show_default=True,
              help="Engines that run on other GPUs: every Ampere-or-newer GPU, or any GPU of the same compute capability.")
@click.option("--version-compatible", is_flag=True, help="Engines that later TensorRT versions can run (lean runtime).")
@click.option("--workspace-gib", type=click.FloatRange(min=0.0625), default=4.0, show_default=True, help="Builder workspace limit.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def build(bundle, require_trt, plugin_libs, timing_cache, hardware_compat, version_compatible, workspace_gib, as_json) -> None:
    """Build one TensorRT engine per ONNX artifact of BUNDLE and record them in its manifest.

    \b
    Strongly typed networks (precision comes from the ONNX types), optimization profiles up to the
    bundle's max_tokens, a persistent timing cache. Needs `tensorrt` importable and a CUDA GPU;
    without them it prints one status line and exits 0 (exit 2 with --require-trt).
    """
    from kvzap_export.bundle.manifest import read_manifest
    from kvzap_export.trt.builder import BuildOptions, build_engines

    read_manifest(bundle)  # a clear error for a missing / unreadable bundle, TensorRT or not
    options = BuildOptions(require_trt=require_trt, plugin_libraries=tuple(plugin_libs), timing_cache=timing_cache,
                           hardware_compat=hardware_compat, version_compatible=version_compatible, workspace_gib=workspace_gib)
    result = build_engines(bundle, options)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"{bundle}: {result['status']}" + (f" (TensorRT {result['tensorrt']}, {result['gpu']})" if result["tensorrt"] else ""), err=True)
    for skipped in result.get("skipped", []):
        click.echo(f"  skipped {skipped['source']}: {skipped['reason']}", err=True)
