"""Bad input to the pipeline command: non-zero exit, one clear line, no traceback, nothing partial."""

import os
import subprocess
import sys

import pytest

from kvzap_export.cli.main import main
from kvzap_export.presets import load_preset
from kvzap_export.surrogate.model import Surrogate, SurrogateConfig
from tests.helpers import synthetic_checkpoint

SMALL = "name: small\nhidden_size: 64\nnum_layers: 2\nnum_attention_heads: 4\nnum_kv_heads: 2\nhead_dim: 16\n" \
        "surrogate:\n  hub_ids: {mlp: nvidia/KVzap-mlp-Small, linear: nvidia/KVzap-linear-Small}\n"


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "small.yaml"
    path.write_text(SMALL)
    weights = synthetic_checkpoint(load_preset(str(path)), "mlp", tmp_path / "weights")
    return path, weights


def _run(args, capsys):
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.err


def _assert_one_line_error(code, err, *needles):
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


def _no_leftovers(parent, name):
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.tmp") or p.name.startswith(f".{name}.old")]


def test_missing_weights(small, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    preset, _ = small
    code, err = _run(["--model", preset, "--out", tmp_path / "out"], capsys)
    _assert_one_line_error(code, err, "nvidia/KVzap-mlp-Small", "hf download")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dims, needle", [((64, 2, 3), "n_modules=3"), ((32, 2, 2), "input_dim=32"), ((64, 4, 2), "output_dim=4")])
def test_checkpoint_does_not_fit_model(small, tmp_path, capsys, dims, needle):
    preset, _ = small
    Surrogate(SurrogateConfig(*dims, 8)).save(tmp_path / "bad")
    code, err = _run(["--model", preset, "--weights", tmp_path / "bad", "--out", tmp_path / "out"], capsys)
    _assert_one_line_error(code, err, needle)
    assert not (tmp_path / "out").exists()


def test_truncated_safetensors(small, tmp_path, capsys):
    preset, weights = small
    data = (weights / "model.safetensors").read_bytes()
    (weights / "model.safetensors").write_bytes(data[:100])
    code, err = _run(["--model", preset, "--weights", weights, "--out", tmp_path / "out"], capsys)
    _assert_one_line_error(code, err, "truncated")


def test_unknown_preset(tmp_path, capsys):
    code, err = _run(["--model", "gpt-17", "--out", tmp_path / "out"], capsys)
    _assert_one_line_error(code, err, "gpt-17", "llama-3.1-8b", "qwen3-8b", "qwen3-32b")


def test_out_is_a_file(small, tmp_path, capsys):
    preset, weights = small
    target = tmp_path / "file"
    target.write_text("keep me")
    code, err = _run(["--model", preset, "--weights", weights, "--out", target], capsys)
    _assert_one_line_error(code, err, "not a directory")
    assert target.read_text() == "keep me"


def test_non_empty_out_without_force_keeps_existing_bundle(small, tmp_path, capsys):
    preset, weights = small
    out = tmp_path / "out"
    assert _run(["--model", preset, "--weights", weights, "--out", out, "--quiet"], capsys)[0] == 3  # written, incomplete
    before = {p.name: p.stat().st_mtime_ns for p in out.rglob("*")}
    code, err = _run(["--model", preset, "--weights", weights, "--out", out], capsys)
    _assert_one_line_error(code, err, "--force")
    assert {p.name: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_failed_run_leaves_existing_bundle_untouched(small, tmp_path, capsys):
    preset, weights = small
    out = tmp_path / "out"
    assert _run(["--model", preset, "--weights", weights, "--out", out, "--quiet"], capsys)[0] == 3  # written, incomplete
    manifest = (out / "manifest.json").read_bytes()
    Surrogate(SurrogateConfig(64, 2, 5, 8)).save(tmp_path / "bad")
    code, err = _run(["--model", preset, "--weights", tmp_path / "bad", "--out", out, "--force"], capsys)
    _assert_one_line_error(code, err, "n_modules=5")
    assert (out / "manifest.json").read_bytes() == manifest
    assert _no_leftovers(tmp_path, "out") == []


def test_force_replaces_bundle(small, tmp_path, capsys):
    preset, weights = small
    out = tmp_path / "out"
    (out / "junk").mkdir(parents=True)
    assert _run(["--model", preset, "--weights", weights, "--out", out, "--force", "--quiet"], capsys)[0] == 3
    assert not (out / "junk").exists() and (out / "manifest.json").is_file()
    assert _no_leftovers(tmp_path, "out") == []


@pytest.mark.parametrize("dtype", ["float64", "int8", "fp8"])
def test_unsupported_dtype(small, tmp_path, capsys, dtype):
    preset, weights = small
    code, err = _run(["--model", preset, "--weights", weights, "--out", tmp_path / "out", "--dtype", dtype], capsys)
    _assert_one_line_error(code, err, dtype, "bfloat16")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, needle", [(["--opset", "17"], "--opset 17"), (["--window", "0"], "--window 0"),
                                          (["--window", str(2**30)], "--window 1073741824"),
                                          (["--threshold", "nan"], "--threshold nan"), (["--threshold", "inf"], "--threshold inf"),
                                          (["--threshold", "abc"], "'abc' is not a valid float"),
                                          (["--sink", "-1"], "--sink -1"), (["--variant", "cnn"], "'cnn' is not one of")])
def test_bad_numbers(small, tmp_path, capsys, args, needle):
    preset, weights = small
    code, err = _run(["--model", preset, "--weights", weights, "--out", tmp_path / "out", *args], capsys)
    _assert_one_line_error(code, err, needle)


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody can write to: a read-only tmpfs as root, chmod 555 otherwise."""
    target = tmp_path / "ro"
    target.mkdir()
    if os.geteuid() == 0:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(target)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"running as root and cannot mount a read-only tmpfs: {done.stderr.decode().strip()}")
        yield target
        subprocess.run(["umount", str(target)], check=False)
    else:
        target.chmod(0o555)
        yield target
        target.chmod(0o755)


def test_unwritable_out(small, read_only_dir, capsys):
    preset, weights = small
    code, err = _run(["--model", preset, "--weights", weights, "--out", read_only_dir / "engine"], capsys)
    _assert_one_line_error(code, err, "write")
    assert list(read_only_dir.iterdir()) == []


@pytest.mark.parametrize("args, missing", [(["--model", "llama-3.1-8b"], "--out"), (["--out", "x"], "--model")])
def test_missing_out_is_one_line_not_the_help(capsys, args, missing):
    code = main(args)
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""  # not the whole help
    assert captured.err == f"error: missing {missing}: the pipeline needs both --model and --out (see `kvzap-export --help`)\n"


def test_unknown_subcommand(capsys):
    code, err = _run(["frobnicate"], capsys)
    _assert_one_line_error(code, err, "frobnicate")


def test_console_script_prints_no_traceback(tmp_path):
    """The installed entry point, in a real process: one line on stderr and exit code 2."""
    done = subprocess.run([sys.executable, "-m", "kvzap_export.cli.main", "--model", "nope", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().startswith("error: --model 'nope'") and "Traceback" not in done.stderr
    assert done.stderr.strip().count("\n") == 0


def test_help_explains_the_pipeline(capsys):
    with pytest.raises(SystemExit) as info:
        from kvzap_export.cli.main import cli

        cli.main(["--help"], prog_name="kvzap-export")
    assert info.value.code == 0
    out = capsys.readouterr().out
    for needle in ("--model", "--out", "--weights", "--dtype", "--force", "--json", "export", "presets"):
        assert needle in out


@pytest.mark.parametrize("args, needle", [
    (["--data", "{tmp}/nope.txt"], "--data {tmp}/nope.txt: no such file or folder"),
    (["--data", "{tmp}/bad.jsonl"], "bad.jsonl:1: not JSON"),
    (["--prompts-per-domain", "1"], "--prompts-per-domain 1"),
    (["--positions-per-prompt", "-1"], "--positions-per-prompt -1"),
])
def test_train_rejects_bad_input_in_one_line_before_loading_the_model(tmp_path, capsys, monkeypatch, args, needle):
    import kvzap_export.llm

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(kvzap_export.llm, "load_llm", no_model)
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    args = [a.format(tmp=tmp_path) for a in args]
    code, err = _run(["train", "--model", "smollm2-135m", "--out", tmp_path / "out", *args], capsys)
    _assert_one_line_error(code, err, needle.format(tmp=tmp_path))
    assert not (tmp_path / "out").exists()
