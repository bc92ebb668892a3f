"""The README's main command on the embedded model, offline: bundle + validation at all three levels."""

import json

import pytest

from kvzap_export.cli.main import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("main") / "engine"
    assert main(["--model", "smollm2-135m", "--out", str(out), "--quiet"]) == 0
    return out


def _check(report, name):
    return next(c for c in report["checks"] if c["name"] == name)


def test_bundle_is_validated_and_intact(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["surrogate"]["variant"] == "mlp" and manifest["pruning"]["threshold"] == -4.0
    assert manifest["parity"]["passed"] is True
    assert main(["verify", str(bundle)]) == 0


def test_decisions_on_real_hidden_states(bundle):
    report = json.loads((bundle / "report" / "parity.json").read_text())
    decision = _check(report, "decision:keep_masks")
    assert decision["status"] == "passed" and decision["detail"]["unexplained_flips"] == 0
    assert 0.2 < decision["detail"]["pruned_fraction"] < 0.8


def test_model_level_physical_compaction_matches_kvpress(bundle):
    report = json.loads((bundle / "report" / "parity.json").read_text())
    model = _check(report, "model:compacted_vs_kvpress")
    detail = model["detail"]
    assert model["status"] == "passed", detail.get("summary")
    assert detail["identical_continuations"] == len(detail["prompts"]) >= 5 and detail["new_tokens"] == 64
    assert detail["max_logits_diff"] <= 1e-3
    layouts = detail["kv_cache_layouts"]
    pruned = detail["pruned_fraction"]
    assert pruned > 0.2
    assert layouts["ragged"]["bytes"] == pytest.approx(layouts["full"]["bytes"] * (1 - pruned), rel=1e-9)
    assert detail["measured_held_bytes"] == layouts["ragged"]["bytes"]  # what the compacted cache's tensors held
    assert layouts["ragged"]["bytes"] <= layouts["per_layer_padded"]["bytes"] <= layouts["uniform"]["bytes"] <= layouts["full"]["bytes"]
