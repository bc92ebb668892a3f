"""The engine driver's keyword arguments (no engine needed): the model's dtype by machine, the settings every mode
needs, the attention backend per mode."""

import pytest

from kvzap_export.integrations.sglang.driver import BASE_ENGINE_ARGS, NO_GRAPH_MODES, NO_GRAPHS, RADIX_MODES, engine_args


@pytest.mark.parametrize("mode", ["ragged", "evict", "mask"])
def test_a_gpu_serves_bfloat16_unless_the_spec_asks(monkeypatch, mode):
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    args = engine_args({"model": "m", "mode": mode})
    assert args["dtype"] == "bfloat16" and "device" not in args
    assert args["attention_backend"] in ("kvzap_ragged", "kvzap_flex")
    assert engine_args({"model": "m", "mode": mode, "dtype": "float32"})["dtype"] == "float32"  # validate's reference dtype
    radix = {"disable_radix_cache": mode not in RADIX_MODES}  # ragged mode runs SGLang's radix cache (KVzap's tree)
    assert all(args[k] == radix.get(k, v) for k, v in BASE_ENGINE_ARGS.items())
    # CUDA graphs: SGLang's defaults in ragged mode (it replays decode graphs, turns default prefill graphs off
    # itself); both phases off in the masking modes, whose Python hooks graph replay would skip
    graphs = {k: args[k] for k in NO_GRAPHS if k in args}
    assert graphs == (NO_GRAPHS if mode in NO_GRAPH_MODES else {}), graphs


def test_the_cpu_engine_keeps_float32(monkeypatch):
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    args = engine_args({"model": "m", "mode": "ragged"})
    assert args["dtype"] == "float32" and args["device"] == "cpu" and args["attention_backend"] == "kvzap_ragged"
    assert engine_args({"model": "m", "mode": "dense", "engine": {"dtype": "bfloat16"}})["dtype"] == "bfloat16"
