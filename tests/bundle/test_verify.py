"""``verify`` finds every kind of damage a bundle can suffer after export, and names it."""

import json
import shutil

import pytest

from kvzap_export.bundle.verify import verify_bundle
from kvzap_export.cli.main import main
from kvzap_export.errors import BundleError
from tests.helpers import preset_with_checkpoint



@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    preset, weights = preset_with_checkpoint(root)
    # Written, validation incomplete (no model ships for this preset, so the model level cannot run): exit 3.
    assert main(["--model", str(preset), "--weights", str(weights), "--out", str(root / "b"), "--quiet"]) == 3
    return root / "b"


@pytest.fixture
def bundle(pristine, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(pristine, copy)
    return copy


def test_pristine_bundle_is_intact(bundle, capsys):
    assert verify_bundle(bundle) == []
    assert main(["verify", str(bundle)]) == 0
    assert "intact" in capsys.readouterr().out


def test_tampered_file(bundle, capsys):
    path = bundle / "onnx" / "surrogate_layer_001.onnx"
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    problems = verify_bundle(bundle)
    assert any("surrogate_layer_001.onnx: sha256 mismatch" in p for p in problems)
    assert main(["verify", str(bundle)]) == 2
    err = capsys.readouterr().err
    assert "sha256 mismatch" in err and err.strip().splitlines()[-1].startswith("error: ")


def test_missing_artifact(bundle):
    (bundle / "onnx" / "surrogate_layer_002.onnx").unlink()
    assert any("surrogate_layer_002.onnx: missing" in p for p in verify_bundle(bundle))


def test_swapped_layer_files_are_caught_even_with_fixed_hashes(bundle):
    """Swap two layers and rewrite the hashes: the layer metadata inside each graph still disagrees."""
    a, b = bundle / "onnx" / "surrogate_layer_000.onnx", bundle / "onnx" / "surrogate_layer_001.onnx"
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    manifest = json.loads((bundle / "manifest.json").read_text())
    from kvzap_export.bundle.manifest import sha256_file

    for art in manifest["artifacts"]:
        art["sha256"] = manifest["files"][art["path"]] = sha256_file(bundle / art["path"])
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    problems = verify_bundle(bundle)
    assert any("graph is layer 1, the manifest says layer 0" in p for p in problems), problems


def test_declared_io_mismatch(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["artifacts"][0]["outputs"] = {"scores": ["float32", ["num_tokens", 5]]}
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    assert any("the manifest declares float32['num_tokens', 5]" in p for p in verify_bundle(bundle))


def test_surrogate_dims_disagree_with_model(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["model"]["num_kv_heads"] = 4
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    assert any("output_dim=2" in p and "num_kv_heads=4" in p for p in verify_bundle(bundle))


def test_unlisted_file(bundle):
    (bundle / "onnx" / "extra.onnx").write_bytes(b"")
    assert any("extra.onnx: not listed" in p for p in verify_bundle(bundle))


def test_unreadable_bundle(tmp_path, capsys):
    with pytest.raises(BundleError, match="not a bundle directory"):
        verify_bundle(tmp_path / "nope")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "manifest.json").write_text("{not json")
    assert main(["verify", str(tmp_path / "b")]) == 2
    assert "unreadable manifest" in capsys.readouterr().err


def test_wrong_schema_version(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="schema_version 99"):
        verify_bundle(bundle)


def test_inspect_summarizes(bundle, capsys):
    assert main(["inspect", str(bundle)]) == 0
    out = capsys.readouterr().out
    assert "small" in out and "surrogate_layer" in out and "τ = -4" in out
