"""Tables never cut an identifier (a piped or 80-column terminal used to print `llama…`, `qwen3…`)."""

import pytest

from kvzap_export.cli.main import main
from kvzap_export.presets import list_presets, load_preset


@pytest.mark.parametrize("columns", ["80", "40"])
def test_presets_table_keeps_every_name_whole(monkeypatch, capsys, columns):
    monkeypatch.setenv("COLUMNS", columns)
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    for name in list_presets():
        hf_id = load_preset(name).hf_id
        assert any(f"│ {name} " in row and (hf_id is None or hf_id in row) for row in rows), (name, out)
