"""The corpus's loaders, on small files shaped like the installed ones (the Debian packages need not be here)."""

import gzip
import subprocess

import pytest

from kvzap_export.errors import MissingDependencyError
from kvzap_export.train import sources
from kvzap_export.texts import held_out_texts, training_topics


def test_kjv_chapters_lose_verse_numbers_and_line_wraps(monkeypatch):
    out = "\nGenesis 1\n\n  1 In the beginning God created\nthe heaven.\n  2 And the earth was\nvoid.\n\nGenesis 2\n\n  1 Thus the heavens.\n"
    monkeypatch.setattr(sources.shutil, "which", lambda name: "/usr/games/bible")
    monkeypatch.setattr(sources, "KJV_BOOKS", ("gen1:1-2:1",))
    monkeypatch.setattr(sources.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=out))
    assert sources._kjv() == ["Genesis 1\n\nIn the beginning God created the heaven. And the earth was void.",
                              "Genesis 2\n\nThus the heavens."]


def test_kjv_without_the_program_says_how_to_install(monkeypatch):
    monkeypatch.setattr(sources.shutil, "which", lambda name: None)
    with pytest.raises(MissingDependencyError, match="bible-kjv.*install_corpus.sh"):
        sources._kjv()


def test_dictd_entries_without_headers_or_braces(tmp_path):
    path = tmp_path / "j.dict.dz"
    path.write_bytes(gzip.compress(b"00-database-short\n   The Jargon\n\nbenchmark\n n.\n\n    A {lie}, see {\n    MIPS}.\n"))
    assert sources._dictd(path, "dict-jargon") == ["benchmark\n n.\n\n    A lie, see MIPS."]
    with pytest.raises(MissingDependencyError, match="dict-jargon"):
        sources._dictd(tmp_path / "missing.dict.dz", "dict-jargon")


def test_every_source_names_its_domain_and_licence():
    assert {s.domain for s in sources.SOURCES} == set(sources.DOMAINS)
    assert all(s.licence and s.title and s.provider for s in sources.SOURCES)
    assert set(sources.HELD_OUT_DOMAINS) == {"legal", "quotations"}
    assert not set(sources.HELD_OUT_DOMAINS) & set(sources.TRAIN_DOMAINS)


def test_training_never_reads_the_python_docs_validation_uses():
    """No sentence of 80+ characters of the reserved texts appears anywhere in the training topics."""
    trained = " ".join(" ".join(t.split()) for t in training_topics())
    for text in held_out_texts(8):
        sentences = [" ".join(s.split()) for s in text.split(". ")]
        assert not [s for s in sentences if len(s) >= 80 and s in trained]
    with pytest.raises(ValueError, match="at most that many"):
        held_out_texts(9)
