"""``kvzap-export build`` and the pipeline's build stage: honest without TensorRT, real with it."""

import json

import pytest

from kvzap_export.cli.main import main
from kvzap_export.presets import load_preset
from kvzap_export.trt.builder import _profile_shapes, tensorrt_status
from tests.helpers import synthetic_checkpoint

SMALL = "name: small\nhidden_size: 64\nnum_layers: 2\nnum_attention_heads: 4\nnum_kv_heads: 2\nhead_dim: 16\n"


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("build")
    (root / "small.yaml").write_text(SMALL)
    weights = synthetic_checkpoint(load_preset(str(root / "small.yaml")), "mlp", root / "w")
    return root, weights


def _export(small, out, *extra):
    root, weights = small
    return main(["--model", str(root / "small.yaml"), "--weights", str(weights), "--out", str(out), "--quiet",
                 "--no-validate", *extra])


@pytest.mark.skipif(tensorrt_status() is None, reason="TensorRT and a GPU are present: the no-TensorRT path does not apply")
def test_without_tensorrt_build_says_so_and_exits_0(small, tmp_path, capsys):
    out = tmp_path / "b"
    assert _export(small, out) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["engines"]["tensorrt"] is None and manifest["tools"]["tensorrt"] is None
    assert "TensorRT is not installed" in manifest["engines"]["status"]
    capsys.readouterr()
    assert main(["build", str(out)]) == 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no engines built: TensorRT is not installed" in err
    assert main(["verify", str(out)]) == 0  # nothing half-written
    assert not (out / "engines").exists()


@pytest.mark.skipif(tensorrt_status() is None, reason="TensorRT and a GPU are present")
def test_require_trt_is_fatal_and_writes_nothing(small, tmp_path, capsys):
    out = tmp_path / "b"
    assert _export(small, out, "--require-trt") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: --require-trt: TensorRT is not installed")
    assert not out.exists() and not list(tmp_path.glob(".b.tmp*"))
    assert _export(small, out) == 0
    capsys.readouterr()
    assert main(["build", str(out), "--require-trt"]) == 2
    assert "--require-trt" in capsys.readouterr().err


def test_build_of_a_missing_bundle_is_a_user_error(tmp_path, capsys):
    assert main(["build", str(tmp_path / "nothing")]) == 2
    assert "not a bundle directory" in capsys.readouterr().err


def test_profiles_cover_max_tokens(small, tmp_path):
    out = tmp_path / "b"
    assert _export(small, out, "--max-tokens", "4096") == 0
    manifest = json.loads((out / "manifest.json").read_text())
    layer = next(a for a in manifest["artifacts"] if a["kind"] == "surrogate_layer")
    assert _profile_shapes(layer, manifest["max_tokens"]) == {"hidden_states": ((1, 64), (512, 64), (4096, 64))}
    compaction = next(a for a in manifest["artifacts"] if a["kind"] == "threshold_compaction")
    shapes = _profile_shapes(compaction, manifest["max_tokens"])
    assert shapes["scores"] == ((1, 2, 1), (1, 2, 512), (8, 2, 4096)) and shapes["lengths"] == ((1,), (1,), (8,))
    assert "threshold" not in shapes  # static scalar inputs need no profile


@pytest.mark.trt
@pytest.mark.gpu
def test_engines_are_built_recorded_and_verified(small, tmp_path):
    out = tmp_path / "b"
    assert _export(small, out) == 0
    assert main(["build", str(out), "--require-trt"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    engines = [a for a in manifest["artifacts"] if a["kind"] == "trt_engine"]
    assert {e["source"] for e in engines} >= {a["path"] for a in manifest["artifacts"] if a["kind"] == "surrogate_layer"}
    assert manifest["tools"]["tensorrt"] and manifest["engines"]["gpu"]
    assert main(["verify", str(out)]) == 0
    assert main(["validate", str(out), "--backends", "torch,onnxrt,trt", "--no-model-level", "--quiet"]) == 0
