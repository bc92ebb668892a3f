"""``kvzap-export bench``: the JSON schema is stable and suites are selectable."""

import json

import pytest

from kvzap_export.cli.main import main


def test_compaction_suite_json_schema(capsys):
    assert main(["bench", "--only", "compaction", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schema"] == "kvzap-export-bench/1"
    assert {"machine", "device", "date", "command", "commit", "torch", "results"} <= set(report)
    rows = report["results"]["compaction"]
    assert list(report["results"]) == ["compaction"]
    assert {r["seq"] for r in rows} == {4096, 32768, 131072}
    ran = [r for r in rows if "skipped" not in r]
    assert {r["backend"] for r in ran} == {"torch_reference", "ort_std_ops", "ort_plugin_node"}
    for row in ran:
        assert row["median_s"] > 0 and row["speedup_vs_torch_reference"] > 0 and row["device"] == "cpu"
    # the GPU kernels keep their rows on a CPU machine, skipped with the reason
    skipped = [r for r in rows if "skipped" in r]
    assert {r["backend"] for r in skipped} == {"triton_kernel", "cuda_kernel"}
    assert all("CUDA GPU" in r["skipped"] for r in skipped)


def test_unknown_suite_is_a_user_error(capsys):
    assert main(["bench", "--only", "compaction,warp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "warp" in err and "scoring" in err


def test_engine_bench_needs_two_new_tokens(tmp_path, capsys):
    """--new-tokens 1 gives no decode step, so no dense concurrency to cap 'ragged at dense's concurrency' at:
    refused in one line before any engine starts (it used to run that configuration uncapped under its label)."""
    assert main(["bench", "--engine", "sglang", "--bundle", str(tmp_path), "--model", str(tmp_path), "--new-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--new-tokens 1" in err and "at least 2" in err



@pytest.mark.parametrize("args, named", [
    (["--configs", "ragged,warp"], ["--configs", "warp", "dense-radix"]),
    (["--configs", "ragged,evict"], ["--configs", "needs dense or dense-radix"]),
    (["--shared-prefix-tokens", "768"], ["--shared-prefix-tokens 768", "add dense-radix"]),
    (["--configs", "dense-radix,ragged", "--shared-prefix-tokens", "1024"], ["--shared-prefix-tokens 1024", "below"]),
])
def test_engine_bench_refuses_configurations_it_cannot_compare(tmp_path, capsys, args, named):
    """Unknown configurations, no baseline, a shared prefix without the radix baseline, or one as long as the prompt:
    one line, before any engine starts."""
    assert main(["bench", "--engine", "sglang", "--bundle", str(tmp_path), "--model", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and all(text in err for text in named), err


@pytest.mark.parametrize("flag, expected", [([], True), (["--kvzap-overlap", "off"], False)])
def test_engine_bench_passes_kvzap_overlap_to_the_benchmark(tmp_path, capsys, monkeypatch, flag, expected):
    """--kvzap-overlap reaches the benchmark (the engine runs are replaced: what is checked is the command's plumbing),
    and the console line names the setting."""
    from kvzap_export.bench import sglang_stream

    seen = {}

    class Stop(Exception):
        pass

    def fake_bench(*args, kvzap_overlap, **kwargs):
        seen["kvzap_overlap"] = kvzap_overlap
        raise Stop

    monkeypatch.setattr(sglang_stream, "bench_sglang", fake_bench)
    python = tmp_path / "python"
    python.write_text("")
    with pytest.raises(Stop):
        main(["bench", "--engine", "sglang", "--bundle", str(tmp_path), "--model", str(tmp_path), "--engine-python",
              str(python), *flag])
    assert seen == {"kvzap_overlap": expected}
    said = capsys.readouterr().err
    assert f"KVzap's configurations with SGLang's overlap scheduler {'on' if expected else 'off'}" in said


@pytest.mark.parametrize("args, named", [
    (["--pruned-fraction", "0.7", "--threshold", "-3"], ["--pruned-fraction", "--threshold -3", "give one of them"]),
    (["--pruned-fraction", "1.5"], ["--pruned-fraction '1.5'", "strictly between 0 and 1"]),
    (["--pruned-fraction", "0.7", "--configs", "dense,ragged-off"], ["--pruned-fraction", "ragged-at-dense"]),
    (["--pruned-fraction", "0.7,0.4", "--configs", "dense,ragged-radix"], ["several fractions", "add ragged"]),
    (["--engine-arg", "max_total_tokens=9"], ["--engine-arg max_total_tokens", "--pool-tokens"]),
    (["--engine-arg", "attention_backend=fa3"], ["--engine-arg attention_backend", "--dense-backend"]),
    (["--engine-arg", "nonsense"], ["--engine-arg 'nonsense'", "KEY=VALUE"]),
])
def test_engine_bench_refuses_bad_gpu_settings_in_one_line(tmp_path, capsys, args, named):
    assert main(["bench", "--engine", "sglang", "--bundle", str(tmp_path), "--model", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and all(text in err for text in named), err


@pytest.mark.parametrize("args", [["--load-format", "dummy"], ["--pruned-fraction", "0.7"], ["--dense-overlap", "on"],
                                  ["--engine-arg", "a=1"]])
def test_engine_options_need_the_engine(capsys, args):
    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and args[0] in err and "--engine sglang" in err


def test_the_gpu_engine_settings_reach_the_benchmark(tmp_path, capsys, monkeypatch):
    """--device cuda, --load-format dummy, --pruned-fraction, --dense-overlap, --engine-arg reach the benchmark (the
    engine runs are replaced: the command's plumbing is checked); the GPU is checked in the engine's Python, its name
    taken from there; the console says how τ is set and that one round is not a median."""
    from kvzap_export.bench import sglang_stream
    from kvzap_export.cli import engine_bench

    seen = {}

    def fake_bench(*args, **kwargs):
        seen.update(kwargs, dense_backends=args[9])
        return {"settings": {}, "dense_backend": {}, "runs": [], "summary": {}, "vs_dense": {}}

    monkeypatch.setattr(sglang_stream, "bench_sglang", fake_bench)
    monkeypatch.setattr("kvzap_export.validate.engine_level.check_engine_gpu", lambda python: seen.setdefault("gpu", python))
    monkeypatch.setattr(engine_bench, "engine_gpu_name", lambda python: "NVIDIA H200")
    python = tmp_path / "python"
    python.write_text("")
    assert main(["bench", "--engine", "sglang", "--bundle", str(tmp_path), "--model", str(tmp_path), "--engine-python",
                 str(python), "--device", "cuda", "--load-format", "dummy", "--pruned-fraction", "0.7,0.4",
                 "--dense-backend", "triton", "--dense-overlap", "on", "--rounds", "1", "--configs",
                 "dense,ragged,ragged-off", "--engine-arg", "sampling_backend=pytorch", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["machine"] == "NVIDIA H200" and json.loads(captured.out)["device"] == "cuda"
    assert seen["gpu"] == str(python) and seen["device"] == "cuda" and seen["load_format"] == "dummy"
    assert seen["pruned_fractions"] == (0.7, 0.4) and seen["dense_overlap"] is True
    assert seen["engine"] == {"sampling_backend": "pytorch"} and seen["dense_backends"] == ("triton",)
    assert "4 engine launches" in captured.err and "probe" not in captured.err
    assert "70%, 40% of them lie below it" in captured.err and "random weights give meaningless scores" in captured.err
    assert "one round: each figure is one run, not a median" in captured.err


def test_failed_runs_print_the_report_and_exit_1_in_one_line(tmp_path, capsys, monkeypatch):
    from kvzap_export.bench import sglang_stream

    monkeypatch.setattr(sglang_stream, "bench_sglang", lambda *a, **k: {
        "settings": {"baseline": "dense"}, "dense_backend": {"chosen": "triton"}, "runs": [], "summary": {}, "vs_dense": {},
        "errors": [{"round": 1, "label": "dense", "error": "NotImplementedError: fa3"}]})
    python = tmp_path / "python"
    python.write_text("")
    assert main(["bench", "--engine", "sglang", "--bundle", str(tmp_path), "--model", str(tmp_path), "--engine-python",
                 str(python), "--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["errors"][0]["label"] == "dense"
    last = captured.err.strip().splitlines()[-1]
    assert "1 run(s) failed" in last and "round 1 dense: NotImplementedError: fa3" in last


def test_save_runs_appends_the_settings_then_each_run_as_it_finishes(tmp_path, capsys, monkeypatch):
    from kvzap_export.bench import sglang_stream

    saved = tmp_path / "runs.jsonl"

    def fake_bench(*args, on_run, **kwargs):
        assert json.loads(saved.read_text())["settings"]["prompt_tokens"] == 64  # the settings come first
        on_run({"label": "dense", "figures": {"tokens_per_s": 3.0}})
        on_run({"round": 1, "label": "ragged", "error": "boom"})
        return {"settings": {}, "dense_backend": {}, "runs": [], "summary": {}, "vs_dense": {}}

    monkeypatch.setattr(sglang_stream, "bench_sglang", fake_bench)
    python = tmp_path / "python"
    python.write_text("")
    assert main(["bench", "--engine", "sglang", "--bundle", str(tmp_path), "--model", str(tmp_path), "--engine-python",
                 str(python), "--prompt-tokens", "64", "--save-runs", str(saved), "--json"]) == 0
    lines = [json.loads(line) for line in saved.read_text().splitlines()]
    assert [line.get("label") for line in lines] == [None, "dense", "ragged"] and lines[0]["machine"]
    capsys.readouterr()
    assert main(["bench", "--save-runs", str(saved)]) == 2
    assert "--save-runs" in capsys.readouterr().err
