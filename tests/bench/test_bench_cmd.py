"""``kvzap-export bench``: the JSON schema is stable and suites are selectable."""

import json

from kvzap_export.cli.main import main


def test_compaction_suite_json_schema(capsys):
    assert main(["bench", "--only", "compaction", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schema"] == "kvzap-export-bench/1"
    assert {"machine", "device", "date", "command", "torch", "results"} <= set(report)
    rows = report["results"]["compaction"]
    assert list(report["results"]) == ["compaction"]
    assert {r["seq"] for r in rows} == {4096, 32768, 131072}
    assert {r["backend"] for r in rows} == {"torch_reference", "ort_std_ops", "ort_plugin_node"}
    for row in rows:
        assert row["median_s"] > 0 and row["speedup_vs_torch_reference"] > 0


def test_unknown_suite_is_a_user_error(capsys):
    assert main(["bench", "--only", "compaction,warp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "warp" in err and "scoring" in err
