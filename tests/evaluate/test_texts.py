"""Which text ``evaluate`` runs on: held-out domains the shipped surrogate never trained on, or reserved Python docs."""

import pytest

from kvzap_export.errors import ConfigError
from kvzap_export.evaluate.run import evaluation_texts
from kvzap_export.texts import held_out_texts
from kvzap_export.train import sources
from tests.helpers import WordTokenizer


def test_a_held_out_domain_gives_prompts_of_that_text(monkeypatch):
    text = " ".join(f"clause{i}" for i in range(5000))
    monkeypatch.setattr(sources, "SOURCES", (sources.Source("l", "legal", "l", "x", "x", lambda: [text]),))
    got = evaluation_texts("legal", 3, WordTokenizer())
    assert len(got) == 3 and all(t.startswith("clause") and len(t.split()) >= 750 for t in got)


def test_python_docs_are_the_reserved_topics_and_their_limit_is_a_usage_error():
    assert evaluation_texts("python-docs", 2, WordTokenizer()) == held_out_texts(2)
    with pytest.raises(ConfigError, match="--prompts 9"):
        evaluation_texts("python-docs", 9, WordTokenizer())
    with pytest.raises(ConfigError, match="--text 'novels'"):
        evaluation_texts("novels", 1, WordTokenizer())


@pytest.mark.slow
def test_evaluate_runs_on_the_chosen_text(monkeypatch, tmp_path):
    """The whole sweep on the embedded model, one short legal prompt: every method at the threshold, the text named."""
    import sysconfig
    from pathlib import Path

    from kvzap_export.evaluate.run import evaluate_quality, write_evaluation

    licence = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    monkeypatch.setattr(sources, "SOURCES", (sources.Source("l", "legal", "l", "x", "x", lambda: [licence]),))
    report = evaluate_quality(prompts=1, prompt_tokens=200, new_tokens=8, thresholds=[-4.0], text="legal")
    assert report["text"] == "legal" and "held-out domain" in report["text_kind"]
    assert [r["method"] for r in report["results"]] == ["kvzap", "random", "recent"]
    assert all(0.0 <= r["next_token_agreement"] <= 1.0 for r in report["results"])
    write_evaluation(tmp_path, report)
    assert "legal and licence texts" in (tmp_path / "evaluate.md").read_text()
