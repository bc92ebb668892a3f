"""The models and bundles of ``.gpu/engine-check/``, made with the package's public functions.

- ``tiny_model_and_bundle``: a tiny model (``export-model NAME --byte-vocab``), its bundle from the random surrogate
  beside it at τ = 0, and the model level of ``validate`` on it, which stores kvpress's greedy tokens (computed here,
  on the CPU, with transformers and kvpress) in ``bundle/report/reference.json``: the engine parity check on the GPU
  compares SGLang's tokens with these. Needs kvpress (the main environment).
- ``dummy_bundle``: a bundle for a config directory whose model SGLang builds with random weights (``--load-format
  dummy``): a seeded random *linear* surrogate, exported without validation (random weights give meaningless scores;
  the benchmark sets τ from the fraction it is to prune, ``KVZAP_PRUNED_FRACTION``). Needs no kvpress: it runs on the
  GPU machine too.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from .layout import NEW_TOKENS, PROMPTS, THRESHOLD


def tiny_model_and_bundle(name: str, root: Path, seed: int = 0) -> dict:
    """``root/model`` and ``root/bundle`` (with kvpress's reference); returns what the manifest records of them."""
    from kvzap_export.bundle.manifest import read_manifest
    from kvzap_export.model_dirs import SURROGATE_DIR, export_model
    from kvzap_export.pipeline import ExportOptions, run_pipeline
    from kvzap_export.validate.model_level import run_model_level

    model = export_model(name, root / "model", seed=seed, byte_vocab=True)
    bundle = root / "bundle"
    run_pipeline(ExportOptions(model=str(model), out=bundle, check=False, weights=str(model / SURROGATE_DIR),
                               threshold=THRESHOLD))
    result = run_model_level(bundle, read_manifest(bundle), model=str(model), prompts=PROMPTS, new_tokens=NEW_TOKENS)
    if result["status"] != "passed":
        raise RuntimeError(f"{name}: the model level (our compacted run vs kvpress) did not pass: {result.get('summary')}")
    reference = json.loads((bundle / "report" / "reference.json").read_text())
    return {"model": f"{name}/model", "bundle": f"{name}/bundle", "seed": seed, "threshold": THRESHOLD,
            "variant": read_manifest(bundle)["surrogate"]["variant"], "reference_prompts": len(reference["prompts"]),
            "reference_new_tokens": reference["max_new_tokens"], "model_level": result.get("summary"),
            "pruned_fraction": result.get("pruned_fraction")}


def dummy_bundle(config_dir: Path, dest: Path, seed: int = 0, dtype: str = "bfloat16") -> dict:
    """``dest``: a bundle for ``config_dir``'s model with a seeded random linear surrogate, not validated (replaced if
    present). Returns its manifest."""
    import torch

    from kvzap_export.bundle.manifest import read_manifest
    from kvzap_export.pipeline import ExportOptions, run_pipeline
    from kvzap_export.presets import load_preset
    from kvzap_export.surrogate.model import Surrogate, SurrogateConfig

    preset = load_preset(str(config_dir))
    torch.manual_seed(seed)
    surrogate = Surrogate(SurrogateConfig(preset.hidden_size, preset.num_kv_heads, preset.num_layers, None))
    with tempfile.TemporaryDirectory(prefix="kvzap-dummy-surrogate-") as tmp:
        surrogate.save(Path(tmp) / "surrogate")
        run_pipeline(ExportOptions(model=str(config_dir), out=Path(dest), weights=str(Path(tmp) / "surrogate"),
                                   dtype=dtype, check=False, force=True))
    return read_manifest(dest)
