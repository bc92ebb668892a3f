"""``train_surrogate`` end to end with the embedded SmolLM2 on a tiny corpus of the user's own (--data)."""

import json
import sysconfig
from pathlib import Path

import pytest

from kvzap_export.errors import ConfigError
from kvzap_export.train import sources

pytestmark = pytest.mark.slow


@pytest.fixture
def held_out_sources(monkeypatch):
    """Small held-out domains (CPython's licence, a few quotations), so the test needs no Debian corpus."""
    licence = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    quotes = "\n\n".join(f"Quotation {i}: the {w} is mightier than the {v}, said someone, once." for i, (w, v) in
                         enumerate([("pen", "sword"), ("tea", "coffee"), ("cat", "dog")] * 60))
    monkeypatch.setattr(sources, "SOURCES", (
        sources.Source("licence", "legal", "CPython licence", "PSF-2.0", "CPython", lambda: [licence]),
        sources.Source("quotes", "quotations", "made up", "test", "test", lambda: [quotes]),
    ))


def test_train_on_user_data_reports_every_domain_and_resumes(tmp_path, held_out_sources, monkeypatch):
    from kvzap_export.llm import load_llm
    from kvzap_export.presets import load_preset
    from kvzap_export.surrogate import load_surrogate
    from kvzap_export.texts import training_topics
    from kvzap_export.train.collect import collect_targets
    from kvzap_export.train.data import corpus_prompts, load_corpus
    from kvzap_export.train.run import train_surrogate

    data = tmp_path / "mine.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in training_topics()[:12]))
    out, cache = tmp_path / "out", tmp_path / "cache"
    result = train_surrogate("smollm2-135m", "both", out, prompts_per_domain=3, held_out_prompts=1, epochs=1,
                             cache_dir=cache, data=[str(data)])
    for variant in ("linear", "mlp"):
        assert set(result["variants"][variant]) == {"data", "in-domain", "legal", "quotations"}
        assert 0.0 < result["variants"][variant]["legal"] <= 1.0
        load_surrogate(out / variant, load_preset("smollm2-135m"))
    report = json.loads((out / "report" / "report.json").read_text())
    assert report["held_out_domains"] == ["legal", "quotations"]
    assert report["prompts_per_domain"]["data"] == {"train": 2, "evaluation": 1}
    assert report["prompts_per_domain"]["legal"] == {"train": 0, "evaluation": 1}
    assert len(report["variants"]["mlp"]["legal"]["per_layer_head"]) == 30
    assert (out / "report" / "r2.png").is_file() and "| legal | held out |" in (out / "report" / "report.md").read_text()

    # Reading the cache a few layers per pass (as a run too large for memory does; the last pass shorter) fits the same surrogates.
    import torch

    from kvzap_export.train import pairs

    monkeypatch.setattr(pairs, "layers_per_pass", lambda *_: 7)
    again = tmp_path / "again"
    # Two weight decays: the first's fits are zeroed here (a constant prediction: validation R² 0), the second is the
    # default; each layer keeps the default's fit, the same as the first run's.
    from kvzap_export.train import fit

    real_fit = fit.fit_mlp_layer

    def zeroed_at_150(*args, weight_decay, **kwargs):
        module, val = real_fit(*args, weight_decay=weight_decay, **kwargs)
        if weight_decay == 150.0:
            with torch.no_grad():
                for p in module.parameters():
                    p.zero_()
        return module, val

    monkeypatch.setattr(fit, "fit_mlp_layer", zeroed_at_150)
    train_surrogate("smollm2-135m", "both", again, prompts_per_domain=3, held_out_prompts=1, epochs=1, cache_dir=cache, data=[str(data)],
                    weight_decay=[150.0, 0.1])
    again_report = json.loads((again / "report" / "report.json").read_text())
    assert any("in 5 pass(es) of up to 7 layer(s)" in n for n in again_report["notes"])
    assert again_report["weight_decay_per_layer"] == [0.1] * 30 and report["weight_decay_per_layer"] == [0.1] * 30
    for variant in ("linear", "mlp"):
        one, many = load_surrogate(out / variant, load_preset("smollm2-135m")), load_surrogate(again / variant, load_preset("smollm2-135m"))
        for (key, a), (_, b) in zip(one.state_dict().items(), many.state_dict().items(), strict=True):
            assert torch.equal(a, b), key
        assert again_report["variants"][variant]["legal"] == report["variants"][variant]["legal"]

    # Resumable: the same prompts are read back; a prompt whose text changed is computed again.
    llm, tokenizer = load_llm("smollm2-135m")
    prompts = corpus_prompts(tokenizer, load_corpus([str(data)]), 3, 1)
    seen = []
    collect_targets(llm, tokenizer, cache, prompts, on_prompt=lambda p, cached: seen.append(cached))
    assert seen == [True] * len(prompts)
    seen.clear()  # a training prompt's file whose positions setting differs from the run's is computed again
    trained = [next(p for p in prompts if not p.test)]
    collect_targets(llm, tokenizer, cache, trained, positions_per_prompt=5, on_prompt=lambda p, cached: seen.append(cached))
    assert seen == [False]
    changed = [prompts[0].__class__(prompts[0].domain, prompts[0].index, prompts[0].text + " more", prompts[0].test)]
    seen.clear()
    collect_targets(llm, tokenizer, cache, changed, on_prompt=lambda p, cached: seen.append(cached))
    assert seen == [False]
    with pytest.raises(ConfigError, match="another model"):  # one cache, one model
        collect_targets(llm, tokenizer, cache, changed, model_id="some-other-model")
