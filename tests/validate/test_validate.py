"""``validate`` on good and deliberately broken bundles: failures are caught and named."""

import json
import shutil

import numpy as np
import onnx
import pytest

from kvzap_export.cli.main import main
from kvzap_export.presets import load_preset
from kvzap_export.validate.run import validate_bundle
from tests.helpers import synthetic_checkpoint

SMALL = "name: small\nhidden_size: 64\nnum_layers: 3\nnum_attention_heads: 4\nnum_kv_heads: 2\nhead_dim: 16\n"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("validate")
    (root / "small.yaml").write_text(SMALL)
    weights = synthetic_checkpoint(load_preset(str(root / "small.yaml")), "mlp", root / "w")
    assert main(["--model", str(root / "small.yaml"), "--weights", str(weights), "--out", str(root / "b"), "--quiet"]) == 0
    return root / "b"


@pytest.fixture
def bundle(pristine, tmp_path):
    shutil.copytree(pristine, tmp_path / "b")
    return tmp_path / "b"


def _failed(report):
    return set(report["failed"])


def test_good_bundle_passes_and_writes_report(bundle, capsys):
    assert main(["validate", str(bundle), "--quiet"]) == 0
    report = json.loads((bundle / "report" / "parity.json").read_text())
    assert report["passed"] and report["failed"] == []
    md = (bundle / "report" / "parity.md").read_text()
    assert md.startswith("# Parity report: PASSED") and "✓" in md
    assert "polygraphy run onnx/surrogate_layer_000.onnx --trt" in md
    assert (bundle / "report" / "polygraphy" / "layer_000_inputs.json").is_file()
    layer_checks = [c for c in report["checks"] if c["name"].startswith("operator:surrogate_layer_")]
    assert len(layer_checks) == 3 and all(c["detail"]["backends"] == ["onnxrt"] for c in layer_checks)
    assert all(1 in c["detail"]["token_counts"] for c in layer_checks)  # includes a shape unlike the export's


def test_manifest_records_validation(pristine):
    manifest = json.loads((pristine / "manifest.json").read_text())
    assert manifest["parity"]["passed"] is True
    assert manifest["parity"]["surrogate_layers"] == {**manifest["parity"]["surrogate_layers"], "status": "passed", "count": 3}


def test_edited_weights_fail(bundle, capsys):
    path = bundle / "onnx" / "surrogate_layer_001.onnx"
    model = onnx.load(str(path))
    init = next(i for i in model.graph.initializer if i.name == "2.bias")
    values = np.frombuffer(init.raw_data, dtype=np.float32).copy()
    values[0] += 0.5
    init.raw_data = values.tobytes()
    onnx.save(model, str(path))
    report = validate_bundle(bundle)
    assert "operator:surrogate_layer_001" in _failed(report)
    assert "operator:surrogate_layer_000" not in _failed(report)
    assert main(["validate", str(bundle), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "operator:surrogate_layer_001" in err and err.count("\n") == 1


def test_edited_surrogate_copy_fails(bundle):
    from safetensors.torch import load_file, save_file

    path = bundle / "surrogate" / "model.safetensors"
    state = load_file(str(path))
    state["layers.2.0.weight"] *= 1.01
    save_file(state, str(path))
    assert "operator:surrogate_layer_002" in _failed(validate_bundle(bundle))


def test_wrong_threshold_in_manifest_fails(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["pruning"]["threshold"] = 3.0
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    report = validate_bundle(bundle)
    assert "bundle:manifest_integrity" in _failed(report)
    check = next(c for c in report["checks"] if c["name"] == "bundle:manifest_integrity")
    assert any("'pruning'" in p for p in check["detail"]["problems"])


def test_swapped_layer_files_fail(bundle):
    a, b = bundle / "onnx" / "surrogate_layer_000.onnx", bundle / "onnx" / "surrogate_layer_002.onnx"
    data_a = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(data_a)
    assert {"operator:surrogate_layer_000", "operator:surrogate_layer_002"} <= _failed(validate_bundle(bundle))


def test_unknown_backend_is_a_user_error(bundle, capsys):
    assert main(["validate", str(bundle), "--backends", "torch,tensorflow"]) == 2
    assert "tensorflow" in capsys.readouterr().err


def test_json_output_is_the_report(bundle, capsys):
    assert main(["validate", str(bundle), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is True and {c["level"] for c in report["checks"]} >= {"bundle", "operator", "decision", "model"}
