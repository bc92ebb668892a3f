"""One small bundle for the validate tests (written once per package; tests copy it before editing)."""

import shutil

import pytest

from kvzap_export.cli.main import main
from kvzap_export.presets import load_preset
from tests.helpers import synthetic_checkpoint

SMALL = "name: small\nhidden_size: 64\nnum_layers: 3\nnum_attention_heads: 4\nnum_kv_heads: 2\nhead_dim: 16\n"


@pytest.fixture(scope="package")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("validate")
    (root / "small.yaml").write_text(SMALL)
    weights = synthetic_checkpoint(load_preset(str(root / "small.yaml")), "mlp", root / "w")
    # No model ships for this preset: the model level cannot run, so the bundle is written as incomplete (exit 3).
    # τ = 0 sits inside the random surrogate's score range, so decisions go both ways.
    assert main(["--model", str(root / "small.yaml"), "--weights", str(weights), "--out", str(root / "b"), "--quiet",
                 "--threshold", "0"]) == 3
    return root / "b"


@pytest.fixture
def bundle(pristine, tmp_path):
    shutil.copytree(pristine, tmp_path / "b")
    return tmp_path / "b"
