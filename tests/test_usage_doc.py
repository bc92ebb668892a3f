"""docs/usage.md: its bundle layout is the layout of a real bundle (written here with the extras the tests install), its exit codes what the commands exit with."""

import fnmatch
import re
from pathlib import Path

from kvzap_export.cli.main import main
from kvzap_export.presets import load_preset
from tests.helpers import synthetic_checkpoint

USAGE = Path(__file__).resolve().parents[1] / "docs" / "usage.md"
SMALL = "name: small\nhidden_size: 64\nnum_layers: 2\nnum_attention_heads: 4\nnum_kv_heads: 2\nhead_dim: 16\n"


def usage_layout() -> list[tuple[str, bool]]:
    """(glob pattern, optional) for every entry of docs/usage.md's bundle block."""
    text = USAGE.read_text()
    section = text[text.index("## The bundle"):]
    block = section[section.index("```\nengine/\n") + len("```\nengine/\n"):]
    block = block[: block.index("```")]
    entries = []
    for line in block.splitlines():
        match = re.match(r"  (\S+)\s*(.*)", line)
        if match:
            path, note = match.groups()
            entries.append((path.replace("NNN", "[0-9][0-9][0-9]"), note.startswith(("(extra:", "(only"))))
    return entries


def test_usage_layout_matches_a_real_bundle(tmp_path):
    (tmp_path / "small.yaml").write_text(SMALL)
    weights = synthetic_checkpoint(load_preset(str(tmp_path / "small.yaml")), "mlp", tmp_path / "w")
    out = tmp_path / "engine"
    assert main(["--model", str(tmp_path / "small.yaml"), "--weights", str(weights), "--out", str(out), "--quiet"]) == 3
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    entries = usage_layout()
    assert len(entries) >= 10
    unlisted = [f for f in files if not any(fnmatch.fnmatch(f, pattern) for pattern, _ in entries)]
    assert unlisted == [], f"in the bundle, not in docs/usage.md: {unlisted}"
    missing = [pattern for pattern, optional in entries if not optional and not any(fnmatch.fnmatch(f, pattern) for f in files)]
    assert missing == [], f"in docs/usage.md, not in the bundle: {missing}"
    # the test extras install matplotlib and polygraphy: the optional report parts exist here
    assert {"report/scores.png", "report/compression.png", "report/polygraphy/layer_000_inputs.json"} <= set(files)


def test_usage_says_what_no_validate_exits_with(tmp_path, capsys):
    """docs/usage.md's exit codes, line by line, for the one case that is not the verdict's code: --no-validate writes
    the bundle with the verdict 'incomplete' and exits 0, as docs/usage.md says (it used to say only 'incomplete: 3')."""
    import json

    text = " ".join(USAGE.read_text().split())
    assert "`--no-validate` runs no check, records the verdict `incomplete` in the manifest, says so in one line and exits 0" in text
    (tmp_path / "small.yaml").write_text(SMALL)
    weights = synthetic_checkpoint(load_preset(str(tmp_path / "small.yaml")), "mlp", tmp_path / "w")
    out = tmp_path / "engine"
    assert main(["--model", str(tmp_path / "small.yaml"), "--weights", str(weights), "--out", str(out), "--no-validate"]) == 0
    assert json.loads((out / "manifest.json").read_text())["parity"]["verdict"] == "incomplete"
    assert "not validated (--no-validate)" in capsys.readouterr().err.splitlines()[-1]
