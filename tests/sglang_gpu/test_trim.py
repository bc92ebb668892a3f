"""SGLang's wheel trimmed for the GPU bundle (scripts/sglang_gpu/engine_bundle/trim.py), on a synthetic wheel."""

from __future__ import annotations

import tarfile

from scripts.sglang_gpu.engine_bundle import trim
from tests.sglang_gpu.wheels import make_wheel

FILES = {
    "sglang/__init__.py": b"x = 1\n",
    "sglang/srt/layers/layernorm.py": b"# kept\n",
    "sglang/srt/mem_cache/rust_tree_core/mem_cache.cpython-312-x86_64-linux-gnu.so": b"\0" * 10,
    "sglang/srt/rust_extensions/_server.cpython-312-x86_64-linux-gnu.so": b"\0" * 1000,
    "sglang/srt/rust_extensions/_grpc.cpython-312-x86_64-linux-gnu.so": b"\0" * 100,
    "sglang/srt/rust_extensions/__init__.py": b"",
    "sglang/multimodal_gen/runtime/server.py": b"# diffusion\n",
    "sglang/test/test_utils.py": b"# tests\n",
    "sglang/benchmark/bench.py": b"# bench\n",
    "sglang/srt/__pycache__/x.cpython-312.pyc": b"\0",
    "sglang-0.5.23.dist-info/entry_points.txt": b"[console_scripts]\n",
}


def test_the_trimmed_archive_keeps_the_engine_and_its_dist_info_and_names_what_it_dropped(tmp_path):
    wheel = make_wheel(tmp_path, "sglang", "0.5.23", ["fastapi"], FILES, tag="cp312-cp312-manylinux_2_34_x86_64")
    report = trim.pack_trimmed(wheel, tmp_path / "out.tar.gz")
    with tarfile.open(tmp_path / "out.tar.gz") as tar:
        names = set(tar.getnames())
        note = tar.extractfile("sglang-0.5.23.dist-info/kvzap_trimmed.txt").read().decode()
    assert names == {"sglang/__init__.py", "sglang/srt/layers/layernorm.py",
                     "sglang/srt/mem_cache/rust_tree_core/mem_cache.cpython-312-x86_64-linux-gnu.so",
                     "sglang/srt/rust_extensions/__init__.py", "sglang-0.5.23.dist-info/entry_points.txt",
                     "sglang-0.5.23.dist-info/METADATA", "sglang-0.5.23.dist-info/kvzap_trimmed.txt"}
    assert report.kept_files == 6
    assert report.dropped["sglang/srt/rust_extensions/_server."] == [1, 1000]
    assert set(report.dropped) == {"sglang/multimodal_gen/", "sglang/test/", "sglang/benchmark/", "__pycache__",
                                   "sglang/srt/rust_extensions/_server.", "sglang/srt/rust_extensions/_grpc."}
    assert "sglang/multimodal_gen/\t1 files" in note and "Rust HTTP server front end" in note


def test_the_same_wheel_packs_to_the_same_bytes(tmp_path):
    wheel = make_wheel(tmp_path, "sglang", "0.5.23", [], FILES)
    trim.pack_trimmed(wheel, tmp_path / "a.tar.gz")
    trim.pack_trimmed(wheel, tmp_path / "b.tar.gz")
    assert (tmp_path / "a.tar.gz").read_bytes() == (tmp_path / "b.tar.gz").read_bytes()


def test_drop_rules_match_paths_not_names_elsewhere():
    assert trim.drop_reason("sglang/srt/models/test_model.py") is None  # not under sglang/test/
    assert trim.drop_reason("sglang/srt/layers/benchmark_utils.py") is None
    assert trim.drop_reason("sglang/srt/rust_extensions/_server_config.py") is None
    assert trim.drop_reason("sglang/__pycache__/a.pyc") == "__pycache__"
