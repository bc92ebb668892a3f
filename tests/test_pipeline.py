"""The bare pipeline command as a user meets it: what it leaves on disk, what it prints, what the manifest holds."""

import json
import os

import pytest

from kvzap_export.cli.main import main
from kvzap_export.presets import load_preset
from tests.helpers import synthetic_checkpoint

SMALL = "name: small\nhidden_size: 64\nnum_layers: 2\nnum_attention_heads: 4\nnum_kv_heads: 2\nhead_dim: 16\n"


@pytest.fixture
def small(tmp_path):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "small.yaml").write_text(SMALL)
    weights = synthetic_checkpoint(load_preset(str(inputs / "small.yaml")), "mlp", inputs / "a-long-directory-name-for-the-surrogate-weights")
    work = tmp_path / "work"
    work.mkdir()
    return inputs / "small.yaml", weights, work


def _strings(node):
    if isinstance(node, dict):
        for key, value in node.items():
            yield key
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)
    elif isinstance(node, str):
        yield node


def test_successful_run_leaves_nothing_beside_out_and_no_machine_paths(small, capsys, monkeypatch):
    preset, weights, work = small
    monkeypatch.chdir(work)
    assert main(["--model", str(preset), "--weights", str(weights), "--out", str(work / "engine"), "--quiet", "--no-validate"]) == 0
    assert sorted(p.name for p in work.iterdir()) == ["engine"]  # no lock, no temporary or backup sibling
    assert main(["--model", str(preset), "--weights", str(weights), "--out", "engine", "--quiet", "--force"]) == 3
    assert sorted(p.name for p in work.iterdir()) == ["engine"]
    manifest = json.loads((work / "engine" / "manifest.json").read_text())
    strings = list(_strings(manifest))
    leaks = [s for s in strings if os.path.isabs(s) or str(work.parent) in s or os.path.expanduser("~") + os.sep in s]
    assert leaks == []
    assert manifest["surrogate"]["source"] == f"local:{weights.name}" and len(manifest["surrogate"]["sha256"]) == 64
    assert manifest["config"]["preset"]["source"] == "local:small.yaml" and "out" not in manifest["config"]["options"]


def test_shipped_preset_sources_name_the_package_not_the_machine(tmp_path):
    from kvzap_export.pipeline import portable_source
    from kvzap_export.presets import CONFIG_DIR

    assert portable_source(str(CONFIG_DIR / "qwen3-8b.yaml")) == "shipped:configs/qwen3-8b.yaml"
    assert portable_source("qwen3-8b") == "qwen3-8b"
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert portable_source(str(tmp_path / "m" / "config.json")) == "local:m/config.json"


def test_progress_on_stderr_every_stage_and_silence(small, capsys):
    preset, weights, work = small
    args = ["--model", str(preset), "--weights", str(weights), "--out", str(work / "engine"), "--threshold", "0"]
    assert main(args) == 3
    captured = capsys.readouterr()
    assert captured.out == ""
    for stage in ("export 2 mlp layers", "synthetic hidden states", "operator level", "decision level"):
        assert stage in captured.err, stage
    summary = captured.err.splitlines()
    assert summary[-1].startswith("incomplete: bundle written to ") and "model:compacted_vs_kvpress did not run" in summary[-1]
    assert any(line.startswith("verdict ") and "incomplete" in line for line in summary)
    assert any(line.startswith("surrogate ") and line.endswith(f"local:{weights.name}") for line in summary)  # never cut

    assert main([*args, "--force", "--quiet"]) == 3
    assert capsys.readouterr().err.count("\n") == 1  # only the one line that says the verdict is incomplete
    assert main([*args, "--force", "--json"]) == 3
    captured = capsys.readouterr()
    assert json.loads(captured.out)["verdict"] == "incomplete" and captured.err.count("\n") == 1


def test_summary_lines_never_cut_a_value():
    from pathlib import Path

    from kvzap_export.cli.export_cmd import summary_lines

    source = "local:" + "x" * 300
    manifest = {"model": {"preset": "p" * 120, "num_layers": 1, "hidden_size": 8, "num_kv_heads": 1},
                "surrogate": {"variant": "mlp", "source": source}, "artifacts": [], "dtype": "float32", "opset": 20,
                "pruning": {"threshold": -4.0, "window": 128, "sink": 0}, "parity": {"verdict": "incomplete", "summary": "s"}}
    lines = summary_lines(manifest, Path("out"))
    assert any(line.endswith(f"mlp from {source}") for line in lines) and any("p" * 120 in line for line in lines)


def test_the_variant_is_the_checkpoints(tmp_path, capsys):
    """A linear checkpoint given with --weights is exported and labelled linear (it used to be labelled with the
    preset's default, mlp, in the manifest and the progress line); --variant mlp against it is a one-line error
    that writes nothing."""
    (tmp_path / "small.yaml").write_text(SMALL)
    linear = synthetic_checkpoint(load_preset(str(tmp_path / "small.yaml")), "linear", tmp_path / "linear")
    out = tmp_path / "engine"
    assert main(["--model", str(tmp_path / "small.yaml"), "--weights", str(linear), "--out", str(out), "--no-validate"]) == 0
    assert json.loads((out / "manifest.json").read_text())["surrogate"]["variant"] == "linear"
    assert "export 2 linear layers" in capsys.readouterr().err
    refused = tmp_path / "refused"
    assert main(["--model", str(tmp_path / "small.yaml"), "--weights", str(linear), "--variant", "mlp",
                 "--out", str(refused), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--variant mlp" in err and "linear surrogate" in err and "--variant linear" in err
    assert not refused.exists()
