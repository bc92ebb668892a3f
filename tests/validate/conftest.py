"""One small bundle for the validate tests (written once per package; tests copy it before editing)."""

import shutil

import pytest

from kvzap_export.cli.main import main
from tests.helpers import preset_with_checkpoint



@pytest.fixture(scope="package")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("validate")
    preset, weights = preset_with_checkpoint(root)
    # No model ships for this preset: the model level cannot run, so the bundle is written as incomplete (exit 3).
    # τ = 0 sits inside the random surrogate's score range, so decisions go both ways.
    assert main(["--model", str(preset), "--weights", str(weights), "--out", str(root / "b"), "--quiet",
                 "--threshold", "0"]) == 3
    return root / "b"


@pytest.fixture
def bundle(pristine, tmp_path):
    shutil.copytree(pristine, tmp_path / "b")
    return tmp_path / "b"
