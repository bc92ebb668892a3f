"""``kvzap-export bench``: the JSON schema is stable and suites are selectable."""

import json

import pytest

from kvzap_export.cli.main import main


def test_compaction_suite_json_schema(capsys):
    assert main(["bench", "--only", "compaction", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schema"] == "kvzap-export-bench/1"
    assert {"machine", "device", "date", "command", "torch", "results"} <= set(report)
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
