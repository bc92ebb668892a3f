"""``kvzap-export export-model``: the HF directory engines load, written where asked."""

import pytest

from kvzap_export.cli.main import main

pytest.importorskip("transformers", reason="export-model needs transformers (the model extra)")


def test_export_model_creates_missing_parent_directories(tmp_path, capsys):
    out = tmp_path / "models" / "tiny"  # models/ does not exist yet, as on a fresh clone
    assert main(["export-model", "tiny-qwen3", "--out", str(out)]) == 0
    assert (out / "config.json").is_file() and not list(tmp_path.glob("models/.*tmp*"))


def test_export_model_under_a_file_is_one_line_error(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["export-model", "tiny-qwen3", "--out", str(tmp_path / "file" / "tiny")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "is not a directory" in err and not (tmp_path / "file" / "tiny").exists()
