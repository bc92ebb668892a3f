"""Training prompts: domains, held-out roles, the user's own data and its errors."""

import json

import pytest

from kvzap_export.errors import InputError
from kvzap_export.train import data, sources
from kvzap_export.train.data import corpus_prompts, domain_prompts, load_corpus, read_user_data
from tests.helpers import WordTokenizer


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


@pytest.fixture
def tiny_sources(monkeypatch):
    """Every domain gets one small source (a few prompts' worth), so nothing needs the Debian corpus."""
    fake = tuple(sources.Source(f"{d}-src", d, d, "test", "test", (lambda d=d: [words(d, 6000)])) for d in sources.DOMAINS)
    monkeypatch.setattr(sources, "SOURCES", fake)
    return fake


def test_held_out_domains_are_never_training_prompts(tiny_sources):
    prompts = corpus_prompts(WordTokenizer(), load_corpus(), prompts_per_domain=5, held_out_prompts=2)
    by_domain = {}
    for p in prompts:
        by_domain.setdefault(p.domain, []).append(p)
    assert set(by_domain) == set(sources.DOMAINS)
    for domain in sources.HELD_OUT_DOMAINS:
        assert len(by_domain[domain]) == 2 and all(p.test for p in by_domain[domain])
    for domain in sources.TRAIN_DOMAINS:
        assert [p.test for p in by_domain[domain]] == [True, False, False, False, False]  # 1 in 8 kept for evaluation
        assert all(p.text.split()[0].startswith(domain) for p in by_domain[domain])
    assert len({p.key for p in prompts}) == len(prompts)


def test_prompts_are_750_to_1250_tokens_spread_over_the_text(tiny_sources):
    prompts = domain_prompts(WordTokenizer(), "narrative", [[words("a", 20000)]], 4, seed=0, test=False)
    firsts = [int(p.text.split()[0][1:]) for p in prompts]
    assert all(data.MIN_TOKENS <= len(p.text.split()) <= data.MAX_TOKENS for p in prompts)
    assert firsts[0] == 0 and firsts[-1] > 10000  # spread, not the first four windows


def test_sources_of_a_domain_take_turns_and_each_is_evaluated():
    prompts = domain_prompts(WordTokenizer(), "qa", [[words("a", 40000)], [words("b", 40000)]], 20, seed=0, test=False)
    assert [p.text[0] for p in prompts[:4]] == ["a", "b", "a", "b"]
    assert {p.text[0] for p in prompts if p.test} == {"a", "b"}


def test_user_data_replaces_the_training_domains(tiny_sources, tmp_path):
    (tmp_path / "a.txt").write_text(words("mine", 4000))
    prompts = corpus_prompts(WordTokenizer(), load_corpus([str(tmp_path)]), 3, 1)
    assert {p.domain for p in prompts} == {data.USER_DOMAIN, *sources.HELD_OUT_DOMAINS}
    assert [p.test for p in prompts if p.domain == data.USER_DOMAIN] == [True, False, False]


def test_user_data_runs_without_an_installed_held_out_domain(monkeypatch, tmp_path):
    def missing():
        from kvzap_export.errors import MissingDependencyError

        raise MissingDependencyError("not installed")

    monkeypatch.setattr(sources, "SOURCES", tuple(sources.Source(d, d, d, "x", "x", missing) for d in sources.HELD_OUT_DOMAINS))
    (tmp_path / "a.txt").write_text(words("mine", 2000))
    notes = []
    prompts = corpus_prompts(WordTokenizer(), load_corpus([str(tmp_path / "a.txt")], notes), 2, 1)
    assert {p.domain for p in prompts} == {data.USER_DOMAIN}
    assert any("legal skipped" in n for n in notes) and any("quotations skipped" in n for n in notes)


def test_jsonl_and_text_files_and_folders(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("second")
    (tmp_path / "a.jsonl").write_text("\ufeff" + json.dumps({"text": "one"}) + "\n\n"
                                      + json.dumps({"text": "two\u2028lines", "id": 3}, ensure_ascii=False) + "\n")
    (tmp_path / "C.TXT").write_text("third")
    (tmp_path / "ignored.bin").write_bytes(b"\x00")
    assert read_user_data([str(tmp_path)]) == ["third", "one", "two\u2028lines", "second"]


@pytest.mark.parametrize("content, message", [
    ('{"text": "ok"}\nnot json\n', "a.jsonl:2: not JSON"),
    ('{"text": 3}\n', 'a.jsonl:1: each line must be an object with a "text" string'),
    ('["text"]\n', 'a.jsonl:1: each line must be an object'),
])
def test_bad_jsonl_names_the_line(tmp_path, content, message):
    (tmp_path / "a.jsonl").write_text(content)
    with pytest.raises(InputError, match=message):
        read_user_data([str(tmp_path / "a.jsonl")])


def test_bad_paths(tmp_path):
    with pytest.raises(InputError, match="no such file or folder"):
        read_user_data([str(tmp_path / "nope.txt")])
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(InputError, match=r"unsupported file type \.csv"):
        read_user_data([str(tmp_path / "x.csv")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="the folder has no"):
        read_user_data([str(tmp_path / "empty")])
    (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(InputError, match="not UTF-8"):
        read_user_data([str(tmp_path / "latin.txt")])
    (tmp_path / "blank.txt").write_text("  \n")
    with pytest.raises(InputError, match="no text found"):
        read_user_data([str(tmp_path / "blank.txt")])


def test_too_little_text_is_one_clear_error(tmp_path):
    (tmp_path / "a.txt").write_text(words("w", 100))
    with pytest.raises(InputError, match="fewer than 750 tokens"):
        corpus_prompts(WordTokenizer(), load_corpus([str(tmp_path / "a.txt")]), 2, 1)
    (tmp_path / "b.txt").write_text(words("w", 1200))  # one prompt: kept for evaluation, none left to train on
    with pytest.raises(InputError, match="all kept for evaluation"):
        corpus_prompts(WordTokenizer(), load_corpus([str(tmp_path / "b.txt")]), 2, 1)
