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
    assert manifest["parity"]["verdict"] == "passed" and manifest["parity"]["not_run"] == []
    assert manifest["surrogate"]["source"] == "shipped:smollm2-135m/mlp"
    assert main(["verify", str(bundle)]) == 0


def test_decisions_on_real_hidden_states(bundle):
    report = json.loads((bundle / "report" / "parity.json").read_text())
    decision = _check(report, "decision:keep_masks")
    detail = decision["detail"]
    assert decision["status"] == "passed" and detail["unexplained_flips"] == 0 and detail["hidden_states"] == "real"
    assert detail["tokens"] >= 2000 and detail["sequences"] >= 2 and detail["decisions_outside_window"] > 0.7 * detail["decisions"]
    assert 0.2 < detail["pruned_fraction"] < 0.8


def test_model_level_physical_compaction_matches_kvpress(bundle):
    report = json.loads((bundle / "report" / "parity.json").read_text())
    model = _check(report, "model:compacted_vs_kvpress")
    detail = model["detail"]
    assert model["status"] == "passed", detail.get("summary")
    assert detail["identical_continuations"] == len(detail["prompts"]) >= 5 and detail["new_tokens"] == 64
    assert detail["max_logits_diff"] <= 1e-3
    assert detail["pruned_fraction"] > 0.2
    from kvzap_export.validate.hidden import TEXTS

    assert detail["prefill_from_capture"].startswith(f"{TEXTS} of 5 prompts")  # the first TEXTS prompts begin captured texts
    # Measured on both sides: our compacted cache's tensors vs the dense cache's tensors less kvpress's own masks.
    assert detail["measured_held_bytes"] == detail["expected_held_bytes"] < detail["measured_full_bytes"]
    assert detail["kvpress_masked_fraction"] == pytest.approx(detail["pruned_fraction"], abs=1e-12)
    layouts = detail["kv_cache_layouts_from_counts"]
    assert layouts["ragged"]["bytes"] <= layouts["per_layer_padded"]["bytes"] <= layouts["uniform"]["bytes"]
