"""The engine driver's keyword arguments (no engine needed): the model's dtype by machine, the settings every mode
needs, the attention backend per mode."""

import os

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


def test_a_float32_gpu_launch_computes_triton_dots_in_ieee_float32(monkeypatch):
    """validate's float32 launches on a GPU: Triton's dot would multiply float32 in TF32 (SGLang's attention
    kernels)."""
    from kvzap_export.integrations.sglang.driver import exact_float32

    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    exact_float32(engine_args({"model": "m", "mode": "ragged"}))  # bfloat16: left alone
    assert "TRITON_F32_DEFAULT" not in os.environ
    exact_float32(engine_args({"model": "m", "mode": "ragged", "dtype": "float32"}))
    assert os.environ["TRITON_F32_DEFAULT"] == "ieee"
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32")  # the caller's own choice stays
    exact_float32(engine_args({"model": "m", "mode": "mask", "dtype": "float32"}))
    assert os.environ["TRITON_F32_DEFAULT"] == "tf32"
    monkeypatch.delenv("TRITON_F32_DEFAULT")
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    exact_float32(engine_args({"model": "m", "mode": "ragged"}))
    assert "TRITON_F32_DEFAULT" not in os.environ


def test_the_cpu_engine_keeps_float32(monkeypatch):
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    args = engine_args({"model": "m", "mode": "ragged"})
    assert args["dtype"] == "float32" and args["device"] == "cpu" and args["attention_backend"] == "kvzap_ragged"
    assert engine_args({"model": "m", "mode": "dense", "engine": {"dtype": "bfloat16"}})["dtype"] == "bfloat16"


def test_gpu_memory_comes_from_nvml_on_a_gpu_engine_and_is_none_on_the_cpu(monkeypatch):
    """A stream's ``gpu_memory``: NVML's whole-device reading (no CUDA context in the driver) beside SGLang's resolved
    mem_fraction_static, on the device CUDA_VISIBLE_DEVICES names first; None on the CPU engine or without NVML."""
    import sys
    import types

    from kvzap_export.integrations.sglang import driver

    asked = []
    nvml = types.SimpleNamespace(nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: asked.append(i) or i,
                                 nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=30 * 2**30, total=140 * 2**30))
    engine = types.SimpleNamespace(server_args=types.SimpleNamespace(resolved_dict=lambda: {"mem_fraction_static": 0.8}))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    memory = driver._gpu_memory(engine)
    assert memory["used_bytes"] == 30 * 2**30 and memory["total_bytes"] == 140 * 2**30 and asked == [3]
    assert memory["mem_fraction_static"] == 0.8
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    assert driver._gpu_memory(engine) is None
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE")
    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace())  # no NVML calls: no reading, no error
    assert driver._gpu_memory(engine) is None


def test_cpu_ranks_get_their_share_of_the_cores_and_a_fixed_pool(monkeypatch):
    """Several ranks on the CPU engine: SGLang binds one NUMA node a rank unless told, and cannot size their pools; the
    driver splits this process's cores evenly and gives each rank a fixed pool, unless the caller set either."""
    from kvzap_export.integrations.sglang import driver

    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    args = driver.engine_args({"model": "m", "mode": "ragged", "engine": {"tp_size": 2}})
    assert args["max_total_tokens"] == driver.CPU_RANKS_POOL_TOKENS
    assert "max_total_tokens" not in driver.engine_args({"model": "m", "mode": "ragged"})
    assert driver.engine_args({"model": "m", "mode": "ragged", "engine": {"dp_size": 2, "max_total_tokens": 99}})[
        "max_total_tokens"] == 99
    monkeypatch.setattr(driver.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    driver.bind_cpu_ranks({"tp_size": 2})
    assert driver.os.environ["SGLANG_CPU_OMP_THREADS_BIND"] == "0-1|2-3"
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "7|8")
    driver.bind_cpu_ranks({"tp_size": 2})
    assert driver.os.environ["SGLANG_CPU_OMP_THREADS_BIND"] == "7|8"  # the caller's
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND")
    with pytest.raises(SystemExit, match="6 engine ranks need at least 6 cores"):
        driver.bind_cpu_ranks({"tp_size": 2, "dp_size": 3})
    assert driver._core_ranges([0, 1, 2, 5]) == "0-2,5" and driver._core_ranges([3]) == "3"


def test_a_reading_line_still_being_written_is_not_read(tmp_path):
    """The driver reads the readings while the engine runs (a request's last reading after each run); a scheduler may
    be appending its idle reading then: a line without its newline yet is left for a later read."""
    from kvzap_export.integrations.sglang.driver import _last_reading, read_readings

    path = tmp_path / "readings.jsonl"
    assert read_readings(path) == [] and _last_reading(path, "a") is None
    path.write_text('{"rid": "a", "t": 1, "tp_rank": 0}\n{"rid": "a", "t": 2, "tp_rank": 0}\n{"event": "idle", "t": 3, "po')
    assert [r["t"] for r in read_readings(path)] == [1, 2]
    assert _last_reading(path, "a")["t"] == 2
