"""What the two engine test modules share (``test_engine.py``: one launch per ``validate --engine sglang``;
``test_engine_streams.py``: request streams through the driver): the bundles both build and the reference prompts.

The references hold 3 prompts x 24 tokens, to fit CI (each launch costs about half a minute of imports on 2 cores):
kvpress's tokens differ from dense ones within them (asserted: with the surrogate re-trained by issue 32 SmolLM2's
first prompt keeps dense tokens for 24 tokens, the second and third differ from token 10-15).
"""

from __future__ import annotations

import json

PROMPTS, NEW_TOKENS = 3, 24


def build_bundle(root, model_dir, model, **options):
    from kvzap_export.bundle.manifest import read_manifest
    from kvzap_export.pipeline import ExportOptions, run_pipeline
    from kvzap_export.validate.model_level import run_model_level

    out = root / "bundle"
    run_pipeline(ExportOptions(model=str(model), out=out, check=False, **options))
    # The model level with the kvpress reference: what `kvzap-export validate` stores in a bundle.
    result = run_model_level(out, read_manifest(out), model=model_dir, prompts=PROMPTS, new_tokens=NEW_TOKENS)
    assert result["status"] == "passed", result.get("summary")
    return out


def reference_prompts(bundle) -> list[list[int]]:
    return [p["prompt_ids"] for p in json.loads((bundle / "report" / "reference.json").read_text())["prompts"]]
