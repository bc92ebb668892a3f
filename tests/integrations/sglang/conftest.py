"""The engine tests' models, each with a bundle whose report holds kvpress's reference tokens: the embedded SmolLM2
(Llama attention, shipped surrogate, τ = -4), a seeded random tiny Qwen3 (Qwen3 attention, random surrogate, τ = 0) and
a seeded random tiny Llama with 4 KV heads (tensor parallelism over 2 ranks, two heads each). Module-scoped: CI runs
the engine modules on different workers (``-n 2 --dist loadscope``)."""

from __future__ import annotations

import pytest

from tests.integrations.sglang.engine_runs import build_bundle


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    from kvzap_export.model_dirs import export_model

    root = tmp_path_factory.mktemp("smollm2")
    model = export_model("smollm2-135m", root / "model")
    return model, build_bundle(root, "smollm2-135m", "smollm2-135m")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from kvzap_export.model_dirs import SURROGATE_DIR, export_model

    root = tmp_path_factory.mktemp("qwen3")
    model = export_model("tiny-qwen3", root / "model")
    return model, build_bundle(root, str(model), model, weights=str(model / SURROGATE_DIR), threshold=0.0)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A seeded random tiny Llama with 4 KV heads (tensor parallelism: 2 heads on each of 2 ranks), random surrogate,
    τ = 0."""
    from kvzap_export.model_dirs import SURROGATE_DIR, export_model

    root = tmp_path_factory.mktemp("llama")
    model = export_model("tiny-llama", root / "model")
    return model, build_bundle(root, str(model), model, weights=str(model / SURROGATE_DIR), threshold=0.0)
