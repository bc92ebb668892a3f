"""docs/benchmarks.md against its JSON run records (``scripts/bench_doc.py``): the committed tables equal what the
records give, a figure edited in a record fails the check naming the table and the record, and docs/bench/INDEX.md
lists every record. Reads files only: no engine, no GPU."""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import bench_doc  # noqa: E402


def check(root: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = bench_doc.main(["--check", "--root", str(root)])
    return code, capsys.readouterr().out


@pytest.fixture
def checkout(tmp_path):
    """A copy of docs/ (the page, the history, every record and rendering) to edit."""
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    return tmp_path


def edit(root: Path, name: str, change) -> None:
    path = root / "docs" / "bench" / name
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc, indent=1))


def test_the_committed_tables_equal_their_json(capsys):
    code, out = check(REPO, capsys)
    assert code == 0, out


# (record, edit, where the check must point, the edited figure as the page would now show it)
EDITS = [
    ("sglang-long-4k-384-pool9-28da601.json", lambda d: d["summary"]["ragged"]["tokens_per_s"].update(median=99.0),
     "docs/benchmarks.md: the table `long-prompts`", "99.00"),
    ("sglang-shared-prefix-radix-302b1de.json", lambda d: d["vs_dense"]["ragged, radix"].update(tokens_per_s_ratio=7.25),
     "docs/benchmarks.md: the table `sglang-shared-prefix`", "7.25"),
    ("gpu-check-h200-2026-11-28-run2.json", lambda d: d["targets"][0].update(value=3.0),
     "docs/benchmarks.md: the table `gpu-check`", "| 3.00 |"),
    ("gpu-check-h100-2026-11-27-f73b1ec.json", lambda d: d["targets"][5].update(value=0.9),
     "docs/benchmarks.md: the table `gpu-check`", "0.900 missed"),
    ("cpu-2026-11-23.json", lambda d: d["results"]["compaction"][4].update(speedup_vs_torch_reference=4.5),
     "docs/benchmarks.md: the table `cpu-bench`", "| 4.5 |"),
    ("e2e-2026-11-26-run3.json", lambda d: d["results"]["e2e"][1].update(s_per_token=0.25),
     "docs/benchmarks.md: the table `e2e`", "| 0.25 |"),
    # a stream suite of several runs: a later run's ratio moves the median over the runs
    ("sglang-stream-1k-c0d15b7.json", lambda d: d["vs_dense"]["ragged"].update(tokens_per_s_ratio=1.60),
     "docs/benchmarks.md: the table `sglang-stream`", "**ragged: 1.47× dense**, the median of 3 runs"),
    # in a full rendering only (each run's launch time; every record of a suite has one), and in INDEX.md only (a
    # record that is no figure of record)
    ("sglang-stream-1k-711be6b.json", lambda d: d["runs"][0]["figures"].update(launch_s=777.0),
     "docs/bench/sglang-stream-1k-711be6b.md", "777.000"),
    ("sglang-stream-1k-b62a210.json", lambda d: d["runs"][4]["figures"].update(launch_s=555.0),
     "docs/bench/sglang-stream-1k-b62a210.md", "555.000"),
    ("sglang-stream-2026-11-26.json", lambda d: d["vs_dense"]["ragged"].update(tokens_per_s_ratio=8.5),
     "docs/bench/INDEX.md", "ragged: 8.50×"),
]


@pytest.mark.parametrize(("name", "change", "where", "shown"), EDITS, ids=[e[0] for e in EDITS])
def test_an_edited_figure_fails_the_check_naming_its_table_and_record(checkout, capsys, name, change, where, shown):
    assert check(checkout, capsys)[0] == 0
    edit(checkout, name, change)
    code, out = check(checkout, capsys)
    assert code == 1
    assert out.startswith(f"{where} differs from") and name in out and shown in out, out
    assert bench_doc.main(["--root", str(checkout)]) == 0  # regenerating makes the page agree again
    code, out = check(checkout, capsys)
    if name.startswith("gpu-check"):  # but not the .md gpu_check.sh wrote beside the record, which is only compared
        assert code == 1 and out.startswith(f"docs/bench/{name[:-5]}.md differs from {name}"), out
    else:
        assert code == 0, out


def test_a_gpu_check_rendering_that_no_longer_shows_its_json_fails(checkout, capsys):
    """The .md beside a GPU check record is gpu_check.sh's, not regenerated here: the check only compares it."""
    md = checkout / "docs" / "bench" / "gpu-check-h100-2026-11-27.md"
    md.write_text(md.read_text().replace("step:build_cuda_library: exit 0 in 12 s", "step:build_cuda_library: exit 0 in 13 s"))
    code, out = check(checkout, capsys)
    assert code == 1 and out.startswith("docs/bench/gpu-check-h100-2026-11-27.md differs from gpu-check-h100-2026-11-27.json")


def test_the_index_lists_every_record():
    index = (REPO / "docs" / "bench" / "INDEX.md").read_text()
    listed = re.findall(r"^\| \[([^\]]+\.json)\]", index, re.MULTILINE)
    assert sorted(listed) == sorted(p.name for p in (REPO / "docs" / "bench").glob("*.json"))


def test_a_record_added_without_regenerating_fails_naming_the_index(checkout, capsys):
    bench = checkout / "docs" / "bench"
    shutil.copy(bench / "sglang-stream-1k-2026-11-27.json", bench / "sglang-stream-1k-2099-01-01.json")
    code, out = check(checkout, capsys)
    assert code == 1 and out.startswith("docs/bench/INDEX.md differs") and "sglang-stream-1k-2099-01-01.json" in out


def test_a_page_without_a_suites_block_is_refused_in_one_line(checkout, capsys):
    page = checkout / "docs" / "benchmarks.md"
    page.write_text(page.read_text().replace("<!-- generated: e2e -->", "<!-- e2e -->"))
    capsys.readouterr()
    assert bench_doc.main(["--check", "--root", str(checkout)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "'e2e'" in err and len(err.strip().splitlines()) == 1


def test_the_page_stays_short():
    assert len((REPO / "docs" / "benchmarks.md").read_text().splitlines()) <= 400
