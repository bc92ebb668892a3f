"""What the two engine test modules share (``test_engine.py``: one launch per ``validate --engine sglang``;
``test_engine_streams.py``: request streams through the driver): the bundles both build and the reference prompts.

The references hold 3 prompts x 24 tokens, to fit CI (each launch costs about half a minute of imports on 2 cores):
kvpress's tokens differ from dense ones within them (asserted: with the surrogate re-trained by issue 32 SmolLM2's
first prompt keeps dense tokens for 24 tokens, the second and third differ from token 10-15).
"""

from __future__ import annotations

import json
import os
import subprocess

PROMPTS, NEW_TOKENS = 3, 24


def run_driver(tmp_path, spec: dict, *, timeout: int = 900, **env: str) -> subprocess.CompletedProcess:
    """The driver (``python -m kvzap_export.integrations.sglang.driver``) on ``spec`` in the SGLang environment's
    Python, on SGLang's CPU engine, with ``env`` added; it writes ``tmp_path / "out.json"``."""
    from tests.conftest import sglang_python

    (tmp_path / "spec.json").write_text(json.dumps(spec))
    return subprocess.run([sglang_python(), "-m", "kvzap_export.integrations.sglang.driver", str(tmp_path / "spec.json"),
                           str(tmp_path / "out.json")], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1", **env})


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


def reference_stream(bundle, copies: int = 4) -> tuple[list[dict], list[list[int]]]:
    """The reference prompts, ``copies`` copies each, kvpress decoding=True and =False mixed, as stream requests, and
    the kvpress tokens each must equal."""
    reference = json.loads((bundle / "report" / "reference.json").read_text())
    stream, expected = [], []
    for _copy in range(copies):
        for prompt in reference["prompts"]:
            for run in prompt["runs"]:
                stream.append({"input_ids": prompt["prompt_ids"], "max_new_tokens": NEW_TOKENS,
                               "kvzap": "decoding" if run["decoding"] else "prefill"})
                expected.append(run["output_ids"])
    return stream, expected
