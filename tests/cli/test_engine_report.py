"""``validate --engine``'s exit codes and report, with the engine level's result given (plumbing: no engine runs
here; the real SGLang runs are tests/integrations/sglang/test_engine.py)."""

from __future__ import annotations

import json

import pytest

from kvzap_export.cli.main import main


@pytest.fixture
def bundle(tmp_path):
    from kvzap_export.presets import load_preset
    from tests.helpers import synthetic_checkpoint

    (tmp_path / "small.yaml").write_text("name: small\nhidden_size: 64\nnum_layers: 2\nnum_attention_heads: 4\n"
                                         "num_kv_heads: 2\nhead_dim: 16\n")
    weights = synthetic_checkpoint(load_preset(str(tmp_path / "small.yaml")), "mlp", tmp_path / "w")
    assert main(["--model", str(tmp_path / "small.yaml"), "--weights", str(weights), "--out", str(tmp_path / "b"),
                 "--quiet", "--no-validate"]) == 0
    return tmp_path / "b"


@pytest.mark.parametrize("status, code", [("passed", 0), ("failed", 1), ("skipped", 3)])
def test_engine_level_exit_code_follows_its_status(bundle, monkeypatch, capsys, status, code):
    result = {"status": status, "engine": "sglang", "mode": "mask", "summary": f"it {status}", "prompts": [],
              "problems": ["tokens differ"] if status == "failed" else []}
    if status == "skipped":
        result["reason"] = "no kvpress reference for 2 of 2 runs"
    monkeypatch.setattr("kvzap_export.validate.engine_level.run_engine_level", lambda *a, **k: result)
    assert main(["validate", str(bundle), "--engine", "sglang", "--model", str(bundle), "--json"]) == code
    captured = capsys.readouterr()
    assert json.loads(captured.out)["status"] == status
    assert (bundle / "report" / "engine-sglang-mask.json").is_file()
    if code:
        assert captured.err.count("\n") == 1 and "engine-sglang-mask.md" in captured.err


def test_engine_level_on_cuda_without_a_gpu_is_a_usage_error(bundle, capsys):
    """--device cuda where the engine's Python sees no GPU: exit 2, one line, before any engine starts (it used to
    start the engine, which failed: exit 1). The probe runs the interpreter given; here this one, torch's CPU build."""
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: the probe passes here")
    (bundle / "config.json").write_text("{}")  # a model directory, as --model wants
    code = main(["validate", str(bundle), "--engine", "sglang", "--model", str(bundle), "--device", "cuda",
                 "--engine-python", sys.executable, "--prompts", str(write_prompts(bundle))])  # no --quiet: still one line
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--device cuda" in err and "sees no CUDA GPU" in err
    assert not (bundle / "report" / "engine-sglang-mask.json").exists()


def write_prompts(bundle):
    path = bundle / "prompts.json"
    path.write_text(json.dumps(["a prompt"]))
    return path


def test_require_engine_follows_the_engine_level(bundle, monkeypatch, capsys):
    """--require engine without --engine is a usage error (it used to fail every time: no engine check ever ran);
    with --engine, an engine level that did not run fails instead of being incomplete; other levels are refused."""
    assert main(["validate", str(bundle), "--require", "engine", "--quiet"]) == 2
    assert "--require engine" in capsys.readouterr().err
    skipped = {"status": "skipped", "engine": "sglang", "mode": "mask", "summary": "no reference", "prompts": [],
               "reason": "no kvpress reference for 2 of 2 runs"}
    monkeypatch.setattr("kvzap_export.validate.engine_level.run_engine_level", lambda *a, **k: skipped)
    engine = ["validate", str(bundle), "--engine", "sglang", "--model", str(bundle), "--quiet"]
    assert main(engine) == 3
    assert main([*engine, "--require", "engine"]) == 1
    capsys.readouterr()
    assert main([*engine, "--require", "operator"]) == 2
    assert "only the engine level runs" in capsys.readouterr().err


def test_chunk_size_and_the_radix_cache_go_to_the_engine_and_need_it(bundle, monkeypatch, capsys):
    seen = recorded_engine_level(monkeypatch)
    assert main(["validate", str(bundle), "--engine", "sglang", "--engine-mode", "ragged", "--model", str(bundle),
                 "--chunk-size", "64", "--json"]) == 0
    assert seen["engine_args"] == {"chunked_prefill_size": 64}
    capsys.readouterr()
    assert main(["validate", str(bundle), "--chunk-size", "64"]) == 2  # without --engine: nothing runs
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--chunk-size 64" in err and "--engine sglang" in err
    assert main(["validate", str(bundle), "--engine", "sglang", "--engine-mode", "ragged", "--model", str(bundle),
                 "--no-radix-cache", "--chunk-size", "64", "--json"]) == 0
    assert seen["engine_args"] == {"chunked_prefill_size": 64, "disable_radix_cache": True}
    assert main(["validate", str(bundle), "--engine", "sglang", "--model", str(bundle), "--json"]) == 0
    assert seen["engine_args"] is None  # the engine's own settings (ragged mode: its radix cache on)
    capsys.readouterr()
    assert main(["validate", str(bundle), "--no-radix-cache"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--no-radix-cache" in err and "--engine sglang" in err


def test_engine_args_reach_the_engine_level_and_bad_ones_are_one_line(bundle, monkeypatch, capsys):
    """--engine-arg KEY=VALUE (repeated): values read as JSON where they are JSON, merged with --chunk-size; malformed,
    repeated or reserved keys, or the option without --engine, are one-line usage errors before anything runs."""
    seen = recorded_engine_level(monkeypatch)
    engine = ["validate", str(bundle), "--engine", "sglang", "--engine-mode", "ragged", "--model", str(bundle), "--json"]
    assert main([*engine, "--engine-arg", "sampling_backend=pytorch", "--engine-arg", "mem-fraction-static=0.3",
                 "--engine-arg", "enable_x=true", "--chunk-size", "64"]) == 0
    assert seen["engine_args"] == {"chunked_prefill_size": 64, "sampling_backend": "pytorch", "mem_fraction_static": 0.3,
                                   "enable_x": True}
    for args, says in ((["--engine-arg", "sampling_backend"], "use KEY=VALUE"),
                       (["--engine-arg", "=3"], "use KEY=VALUE"),
                       (["--engine-arg", "a b=3"], "use KEY=VALUE"),
                       (["--engine-arg", "x=1", "--engine-arg", "x=2"], "given twice"),
                       (["--engine-arg", "dtype=bfloat16"], "float32"),
                       (["--engine-arg", "chunked_prefill_size=8"], "--chunk-size")):
        seen.clear()
        capsys.readouterr()
        assert main([*engine, *args]) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err and not seen, (args, err)
    assert main(["validate", str(bundle), "--engine-arg", "x=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--engine-arg x=1" in err and "--engine sglang" in err


def test_tp_size_goes_to_the_engine_and_needs_it(bundle, monkeypatch, capsys):
    """--tp-size N reaches the engine as its tp_size; without --engine, or through --engine-arg, it is a one-line usage
    error."""
    seen = recorded_engine_level(monkeypatch)
    engine = ["validate", str(bundle), "--engine", "sglang", "--engine-mode", "ragged", "--model", str(bundle), "--json"]
    assert main([*engine, "--tp-size", "2"]) == 0 and seen["engine_args"] == {"tp_size": 2}
    for args, says in ((["validate", str(bundle), "--tp-size", "2"], "--engine sglang"),
                       ([*engine, "--engine-arg", "tp_size=2"], "--tp-size"),
                       ([*engine, "--tp-size", "0"], "0"),
                       (["bench", "--tp-size", "2"], "--engine sglang")):
        capsys.readouterr()
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert says in err and err.strip().count("\n") <= 1, err


def test_bench_tp_size_reaches_every_launch(monkeypatch, capsys):
    """bench --engine sglang --tp-size 2: the engine arguments every launch gets carry tp_size 2 (the launches are
    recorded, not run)."""
    import sys

    seen = {}

    def fake(*args, **kwargs):
        seen.update(kwargs)
        raise SystemExit(0)

    monkeypatch.setattr("kvzap_export.bench.sglang_stream.bench_sglang", fake)
    with pytest.raises(SystemExit):
        main(["bench", "--engine", "sglang", "--bundle", "b", "--model", "m", "--engine-python", sys.executable,
              "--tp-size", "2", "--json"])
    assert seen["engine"] == {"tp_size": 2}


def recorded_engine_level(monkeypatch) -> dict:
    """The engine level replaced by a passing one that records its keyword arguments (returned, filled when called)."""
    seen = {}

    def fake(*args, **kwargs):
        seen.update(kwargs)
        return {"status": "passed", "engine": "sglang", "mode": "ragged", "summary": "ok", "prompts": [], "problems": []}

    monkeypatch.setattr("kvzap_export.validate.engine_level.run_engine_level", fake)
    return seen
