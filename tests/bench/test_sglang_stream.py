"""The SGLang stream benchmark's workload and plan (no engine: the launches are recorded, the figures made up)."""

from __future__ import annotations

import pytest

from kvzap_export.bench import sglang_stream
from kvzap_export.errors import ConfigError


def tokenizer(text: str) -> dict:
    return {"input_ids": [ord(c) for c in text]}


def test_prompts_share_exactly_their_first_tokens():
    plain = sglang_stream.stream_prompts(tokenizer, 4, 50)
    shared = sglang_stream.stream_prompts(tokenizer, 4, 50, shared=30)
    assert all(len(p) == 50 for p in plain + shared)
    assert len({tuple(p[:30]) for p in shared}) == 1  # one prefix
    assert len({tuple(p[30:]) for p in shared}) == 4  # distinct parts
    assert len({p[30] for p in shared}) == 4  # distinct from the first token after the prefix
    assert plain[0][:30] == shared[0][:30]  # the prefix is the text's opening
    assert len({tuple(p[:1]) for p in plain}) > 1  # without a shared prefix the prompts differ from their start
    with pytest.raises(ConfigError, match="--shared-prefix-tokens 50"):
        sglang_stream.stream_prompts(tokenizer, 4, 50, shared=50)


def test_configs_and_their_baseline():
    assert sglang_stream.parse_configs("dense, ragged,dense") == ("dense", "ragged")
    assert sglang_stream.baseline_of(("dense", "ragged")) == "dense"
    assert sglang_stream.baseline_of(("dense", "dense-radix", "ragged")) == "dense, radix"
    with pytest.raises(ConfigError, match="needs dense or dense-radix"):
        sglang_stream.parse_configs("ragged,ragged-off")


def test_the_plan_turns_the_radix_cache_on_for_dense_radix_only_and_caps_after_the_baseline(monkeypatch):
    """Each launch's spec: the radix cache on only for "dense, radix"; the capped ragged run comes after the baseline of
    its round and takes the baseline's concurrency; ratios are against the baseline."""
    launched = []
    running = {"dense, radix": 5, "ragged": 9, "ragged at dense's concurrency": 5}

    def fake_stream(python, spec, **launch):
        label = ("dense, radix" if spec["mode"] == "dense" else
                 "ragged at dense's concurrency" if spec["engine"]["max_running_requests"] != 4 else "ragged")
        launched.append((label, spec))
        return {"label": label, "engine": {"args": spec["engine"]}}

    def fake_figures(result):
        label = result["label"]
        return _figures(2.0 if label == "ragged" else 1.0, running[label])

    monkeypatch.setattr(sglang_stream, "run_stream", fake_stream)
    monkeypatch.setattr(sglang_stream, "run_figures", fake_figures)
    monkeypatch.setattr(sglang_stream, "StreamBench", _bench_without_tokenizer())
    out = sglang_stream.bench_sglang("b", "m", "python", requests=4, rounds=2, dense_backends=("torch_native",),
                                     configs=("ragged-at-dense", "dense-radix", "ragged"), shared=8)
    probes, launched = launched[:2], launched[2:]  # the dense probe: the backend with the overlap scheduler off, on
    assert [spec["engine"].get("disable_overlap_schedule", True) for _, spec in probes] == [True, False]
    # the baseline is "dense, radix": the probe runs with the radix cache on, as the baseline does
    assert [spec["engine"]["disable_radix_cache"] for _, spec in probes] == [False, False]
    order = [label for label, _ in launched]
    assert order == ["dense, radix", "ragged", "ragged at dense's concurrency"] * 2
    # both probes ran at 1 token/s: the first (overlap off) is kept, and the dense runs take it
    assert out["dense_backend"]["overlap"] is False
    # KVzap's runs keep SGLang's default (on): the spec leaves it to the driver
    assert [spec["engine"].get("disable_overlap_schedule") for _, spec in launched] == [True, None, None] * 2
    for label, spec in launched:
        assert spec["engine"].get("disable_radix_cache", True) is (label != "dense, radix")
    assert [spec["engine"]["max_running_requests"] for label, spec in launched if "concurrency" in label] == [5, 5]
    assert out["settings"]["baseline"] == "dense, radix" and out["settings"]["shared_prefix_tokens"] == 8
    assert out["vs_dense"]["ragged"]["tokens_per_s_ratio"] == pytest.approx(2.0)
    assert [r["radix_cache"] for r in out["runs"][:3]] == [True, False, False]


def test_kvzap_overlap_off_turns_the_overlap_scheduler_off_in_kvzaps_runs_only(monkeypatch):
    """--kvzap-overlap off: every KVzap launch asks SGLang for its overlap scheduler off; the dense runs keep the probe's
    setting (here on, the faster probe), and the settings record the choice."""
    launched = []

    def fake_stream(python, spec, **launch):
        launched.append(spec)
        fast = spec["mode"] == "dense" and spec["engine"].get("disable_overlap_schedule") is False
        return {"fast": fast, "engine": {"args": spec["engine"]}}

    def fake_figures(result):
        return _figures(2.0 if result["fast"] else 1.0, 4)

    monkeypatch.setattr(sglang_stream, "run_stream", fake_stream)
    monkeypatch.setattr(sglang_stream, "run_figures", fake_figures)
    monkeypatch.setattr(sglang_stream, "StreamBench", _bench_without_tokenizer())
    out = sglang_stream.bench_sglang("b", "m", "python", requests=4, rounds=1, dense_backends=("torch_native",),
                                     configs=("dense", "ragged-radix", "ragged-off"), kvzap_overlap=False)
    runs = launched[2:]
    assert out["dense_backend"]["overlap"] is True
    assert [(spec["mode"], spec["engine"]["disable_overlap_schedule"]) for spec in runs] == [
        ("dense", False), ("ragged", True), ("ragged", True)]
    assert [r["overlap_schedule"] for r in out["runs"]] == [True, False, False]
    assert out["settings"]["kvzap_overlap"] is False


def _figures(tokens_per_s: float, max_running: int) -> dict:
    """A run's figures, made up: what the plan and the comparisons read."""
    return {"tokens_per_s": tokens_per_s, "max_running": max_running, "decode_step_s": {}, "bytes": {},
            "freed_at_peak": 0.5, "prefill_s_per_1k_tokens": 1.0, "wall_s": 1.0}


def _bench_without_tokenizer():
    class Bench(sglang_stream.StreamBench):
        def __init__(self, bundle, model, python, requests, prompt_tokens, new_tokens, pool_tokens, engine, shared,
                     **settings):
            self.bundle, self.model, self.python, self.requests = bundle, model, python, requests
            self.prompt_tokens, self.new_tokens, self.shared = prompt_tokens, new_tokens, shared
            self.pool_tokens, self.device = 100, settings.get("device", "cpu")
            self.prompts = [[1] * prompt_tokens for _ in range(requests)]
            self.engine = {"max_total_tokens": 100, "max_running_requests": requests, "disable_radix_cache": True}

        def provenance(self):
            return {"shared_prefix_tokens": self.shared}

    return Bench


def test_pruned_fractions_go_to_every_ragged_launch_and_nowhere_else(monkeypatch):
    """--pruned-fraction 0.7,0.4: each ragged-mode launch gets KVZAP_PRUNED_FRACTION (the first fraction for the ragged
    configurations, ragged-off included, where it decides nothing; a further run at 0.4), dense none; labels say the
    fraction; the runs record it; the device reaches every launch; a fixed backend and overlap setting probe nothing."""
    launched = []

    def fake_stream(python, spec, device="cpu", env=None):
        launched.append((spec["mode"], spec["stream"][0]["kvzap"], device, env))
        return {"engine": {"args": spec["engine"]}, "gpu_memory": {"used_bytes": 7}}

    monkeypatch.setattr(sglang_stream, "run_stream", fake_stream)
    monkeypatch.setattr(sglang_stream, "run_figures", lambda result: _figures(1.0, 2))
    monkeypatch.setattr(sglang_stream, "StreamBench", _bench_without_tokenizer())
    out = sglang_stream.bench_sglang("b", "m", "python", requests=4, rounds=1, dense_backends=("triton",),
                                     configs=("dense", "ragged", "ragged-off"), pruned_fractions=(0.7, 0.4),
                                     device="cuda", dense_overlap=True)
    assert launched == [("dense", "decoding", "cuda", None),
                        ("ragged", "decoding", "cuda", {"KVZAP_PRUNED_FRACTION": "0.7"}),
                        ("ragged", "decoding", "cuda", {"KVZAP_PRUNED_FRACTION": "0.4"}),
                        ("ragged", "off", "cuda", {"KVZAP_PRUNED_FRACTION": "0.7"})]
    assert [(r["label"], r["pruned_fraction"]) for r in out["runs"]] == [
        ("dense", None), ("ragged, 70% pruned", 0.7), ("ragged, 40% pruned", 0.4), ("ragged, KVzap off", 0.7)]
    assert out["dense_backend"] == {"candidates": {}, "chosen": "triton", "overlap": True, "probe": None}
    assert out["runs"][0]["gpu_memory"] == {"used_bytes": 7}
    assert out["settings"]["pruned_fractions"] == [0.7, 0.4] and out["settings"]["device"] == "cuda"
    with pytest.raises(ConfigError, match="--threshold and --pruned-fraction"):
        sglang_stream.bench_sglang("b", "m", "python", threshold=-3.0, pruned_fractions=(0.5,))


def test_the_launch_environment_by_device_and_fraction(monkeypatch):
    monkeypatch.setenv("KVZAP_PRUNED_FRACTION", "0.9")  # never inherited: the plugin refuses it outside ragged mode
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    cpu = sglang_stream.launch_env("cpu")
    assert cpu["SGLANG_USE_CPU_ENGINE"] == "1" and "KVZAP_PRUNED_FRACTION" not in cpu
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    gpu = sglang_stream.launch_env("cuda", {"KVZAP_PRUNED_FRACTION": "0.4"})
    assert "SGLANG_USE_CPU_ENGINE" not in gpu and gpu["KVZAP_PRUNED_FRACTION"] == "0.4"
    assert gpu["PATH"] == sglang_stream.os.environ["PATH"]


def test_dummy_weights_get_seeded_random_prompts_and_no_tokenizer(tmp_path):
    """--load-format dummy: prompts are seeded random ids within the config's vocabulary, special ids left out, a shared
    prefix kept; the engine loads dummy weights and skips its tokenizer (the directory has none)."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 50, "bos_token_id": 0, "eos_token_id": [1, 2]}))
    bench = sglang_stream.StreamBench("b", str(tmp_path), "python", requests=3, prompt_tokens=40, new_tokens=4,
                                      shared=8, load_format="dummy", engine={"sampling_backend": "pytorch"})
    again = sglang_stream.StreamBench("b", str(tmp_path), "python", requests=3, prompt_tokens=40, new_tokens=4,
                                      shared=8, load_format="dummy")
    assert bench.prompts == again.prompts and all(len(p) == 40 for p in bench.prompts)
    assert len({tuple(p[:8]) for p in bench.prompts}) == 1 and len({tuple(p[8:]) for p in bench.prompts}) == 3
    ids = {t for p in bench.prompts for t in p}
    assert ids <= set(range(3, 50)) and len(ids) > 30
    assert bench.engine["load_format"] == "dummy" and bench.engine["skip_tokenizer_init"] is True
    assert bench.engine["sampling_backend"] == "pytorch"
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="no vocab_size"):
        sglang_stream.StreamBench("b", str(tmp_path), "python", load_format="dummy")


@pytest.mark.parametrize("text, ok", [("0.7", (0.7,)), ("0.7,0.4,0.7", (0.7, 0.4)), ("1", None), ("0", None),
                                      ("most", None), ("", None)])
def test_pruned_fractions_are_strictly_between_0_and_1(text, ok):
    if ok is None:
        with pytest.raises(ConfigError, match="strictly between 0 and 1"):
            sglang_stream.parse_fractions(text)
    else:
        assert sglang_stream.parse_fractions(text) == ok


def test_a_failed_launch_is_recorded_and_the_other_runs_still_run(monkeypatch):
    """A launch that fails (e.g. the dense baseline on a backend this GPU lacks) is recorded with its last line; the
    other configurations run; without the baseline there is no comparison, and the run capped at its concurrency is
    recorded as not run."""
    def fake_stream(python, spec, **launch):
        if spec["mode"] == "dense":
            raise RuntimeError("SGLang dense run failed:\nTraceback ...\nNotImplementedError: fa3 is a stand-in")
        return {"engine": {"args": spec["engine"]}}

    monkeypatch.setattr(sglang_stream, "run_stream", fake_stream)
    monkeypatch.setattr(sglang_stream, "run_figures", lambda result: _figures(1.0, 2))
    monkeypatch.setattr(sglang_stream, "StreamBench", _bench_without_tokenizer())
    events = []
    out = sglang_stream.bench_sglang("b", "m", "python", requests=4, rounds=1, dense_backends=("fa3",), dense_overlap=True,
                                     configs=("dense", "ragged", "ragged-at-dense"), on_event=events.append)
    assert [r["label"] for r in out["runs"]] == ["ragged"] and out["vs_dense"] == {}
    assert [(e["label"], e["error"]) for e in out["errors"]] == [
        ("dense", "NotImplementedError: fa3 is a stand-in"),
        ("ragged at dense's concurrency", "not run: dense's run of the round failed")]
    assert any("dense: FAILED: NotImplementedError" in e for e in events)
