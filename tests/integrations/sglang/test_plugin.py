"""The SGLang plugin entry point without an engine: declared by the package, off without a bundle, one line
on a wrong setting (checked before SGLang is imported, so these run in the main environment).

What the plugin registers and builds inside SGLang is tested in the real engine (test_engine.py).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys

import pytest

from kvzap_export.integrations.sglang import plugin


@pytest.fixture
def clean(monkeypatch):
    monkeypatch.setattr(plugin, "_CONFIG", None)
    monkeypatch.setattr(plugin, "_RUNTIME", None)
    for name in ("KVZAP_BUNDLE", "KVZAP_MODE", "KVZAP_DECODING", "KVZAP_STATS", "KVZAP_THRESHOLD",
                 "KVZAP_PRUNED_FRACTION", "KVZAP_RAGGED_DECODE_KERNEL", "KVZAP_RAGGED_DECODE"):
        monkeypatch.delenv(name, raising=False)


def test_entry_point_is_declared_by_the_package():
    """Installing kvzap-export next to SGLang is enough: SGLang finds the plugin by this group."""
    found = [ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins") if ep.name == "kvzap"]
    assert len(found) == 1, "kvzap-export is not installed with its entry points (pip install -e .)"
    assert found[0].value == "kvzap_export.integrations.sglang.plugin:load_plugin"
    assert found[0].load() is plugin.load_plugin


def test_plugin_is_off_without_a_bundle(clean):
    assert plugin.load_plugin() is None and plugin._CONFIG is None


@pytest.mark.parametrize("env, named", [
    ({"KVZAP_BUNDLE": "{tmp}/missing"}, "not a bundle directory"),
    ({"KVZAP_BUNDLE": "{tmp}"}, "no manifest.json"),
    ({"KVZAP_BUNDLE": "{tmp}", "KVZAP_DECODING": "yes"}, "KVZAP_DECODING='yes'"),
    ({"KVZAP_BUNDLE": "{tmp}", "KVZAP_MODE": "drop"}, "KVZAP_MODE='drop'"),
    ({"KVZAP_BUNDLE": "{tmp}", "KVZAP_THRESHOLD": "low"}, "KVZAP_THRESHOLD='low'"),
    ({"KVZAP_BUNDLE": "{tmp}", "KVZAP_MODE": "ragged", "KVZAP_PRUNED_FRACTION": "1.5"}, "KVZAP_PRUNED_FRACTION='1.5'"),
    ({"KVZAP_BUNDLE": "{tmp}", "KVZAP_MODE": "ragged", "KVZAP_PRUNED_FRACTION": "most"}, "KVZAP_PRUNED_FRACTION='most'"),
    ({"KVZAP_BUNDLE": "{tmp}", "KVZAP_MODE": "evict", "KVZAP_PRUNED_FRACTION": "0.4"}, "a ragged-mode benchmark setting"),
    ({"KVZAP_BUNDLE": "{tmp}", "KVZAP_MODE": "ragged", "KVZAP_RAGGED_DECODE_KERNEL": "triton"},
     "KVZAP_RAGGED_DECODE_KERNEL='triton': use one of ['sglang', 'torch']"),
    # the switch's former name (its values named the opposite of what ran on CUDA) is refused, naming the new one
    ({"KVZAP_BUNDLE": "{tmp}", "KVZAP_MODE": "ragged", "KVZAP_RAGGED_DECODE": "flattened"},
     "KVZAP_RAGGED_DECODE='flattened' is no longer read: it is now KVZAP_RAGGED_DECODE_KERNEL"),
])
def test_plugin_stops_on_a_wrong_setting_instead_of_serving_without_kvzap(clean, monkeypatch, tmp_path, env, named):
    """SGLang logs and ignores a plugin's exception; SystemExit is not an Exception, so the launch stops."""
    for key, value in env.items():
        monkeypatch.setenv(key, value.format(tmp=tmp_path))
    with pytest.raises(SystemExit) as info:
        plugin.load_plugin()
    message = str(info.value.code)
    assert message.startswith("kvzap-export: ") and named in message and "\n" not in message
    assert plugin._CONFIG is None


@pytest.mark.parametrize("env", [{"KVZAP_BUNDLE": "{tmp}"}, {"KVZAP_STATS": "{tmp}/stats.jsonl"}])
def test_another_sglang_version_stops_the_launch_naming_both(clean, monkeypatch, tmp_path, env):
    """The glue names SGLang internals of one release; any other version stops every process at plugin load
    whenever the plugin would hook SGLang (KVzap on, or the readings-only baseline), and never otherwise."""
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.5.24" if name == "sglang" else real(name))
    assert plugin.load_plugin() is None  # nothing configured: another SGLang runs as if the plugin were absent
    for key, value in env.items():
        monkeypatch.setenv(key, value.format(tmp=tmp_path))
    with pytest.raises(SystemExit) as info:
        plugin.load_plugin()
    message = str(info.value.code)
    assert message == ("kvzap-export: KVzap's SGLang glue is written against sglang 0.5.23, this process has sglang "
                       "0.5.24; install sglang==0.5.23 (or a kvzap-export release for 0.5.24)")


def test_evict_mode_says_at_launch_when_one_length_per_request_frees_nothing(tmp_path):
    """The bundle's model level measured what one KV length per request frees; 0% gives a warning naming both
    layouts' figures, a layout that frees memory gives none, a bundle without the measurement gives none."""
    import json

    def report(uniform):
        layouts = {"uniform": {"freed_fraction": uniform}, "ragged": {"freed_fraction": 0.41}}
        check = {"name": "model:compacted_vs_kvpress", "detail": {"kv_cache_layouts_from_counts": layouts}}
        (tmp_path / "report").mkdir(exist_ok=True)
        (tmp_path / "report" / "parity.json").write_text(json.dumps({"checks": [check]}))

    assert plugin.evict_frees_nothing(tmp_path) is None
    report(0.0)
    line = plugin.evict_frees_nothing(tmp_path)
    assert "frees nothing" in line and "freed 0.0%" in line and "freed 41.0%" in line and "KVZAP_MODE=ragged" in line
    assert "τ = -2.5" in plugin.evict_frees_nothing(tmp_path, -2.5)
    report(0.2)
    assert plugin.evict_frees_nothing(tmp_path) is None


@pytest.mark.slow
def test_plugin_without_sglang_stops_with_one_line(clean, monkeypatch, tmp_path):
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed in this environment")
    from kvzap_export.pipeline import ExportOptions, run_pipeline

    bundle = tmp_path / "bundle"
    run_pipeline(ExportOptions(model="smollm2-135m", out=bundle, check=False))
    monkeypatch.setenv("KVZAP_BUNDLE", str(bundle))
    with pytest.raises(SystemExit) as info:
        plugin.load_plugin()
    message = str(info.value.code)
    assert "\n" not in message and "pip install sglang==0.5.23" in message and "sglang_cpu_env.sh" in message
    assert "sglang" not in sys.modules and plugin._CONFIG is None


@pytest.mark.parametrize("mode, decode, prefill, compile_, path, refused", [
    ("ragged", False, False, False, "", None), ("ragged", True, False, False, "", None),  # ragged decode runs in graphs
    ("ragged", True, False, False, "sglang", None),
    ("ragged", True, True, False, "", "prefill graphs are captured (add --cuda-graph-backend-prefill disabled"),
    ("ragged", False, True, False, "", "prefill graphs are captured (add --cuda-graph-backend-prefill disabled"),
    ("ragged", False, False, True, "", "torch.compile is on (drop --enable-torch-compile"),
    ("ragged", True, False, False, "torch", "decode graphs are captured with KVZAP_RAGGED_DECODE_KERNEL=torch (add "
                                            "--cuda-graph-backend-decode disabled"),
    ("ragged", False, False, False, "torch", None),
    ("mask", False, False, False, "", None),
    ("mask", True, False, False, "", "graphs are captured (add --cuda-graph-backend-decode disabled "
                                     "--cuda-graph-backend-prefill disabled"),
    ("evict", False, True, False, "", "graphs are captured (add --cuda-graph-backend-decode disabled"),
])
def test_graphs_a_mode_cannot_run_stop_the_launch_before_the_capture_in_one_line(clean, monkeypatch, mode, decode,
                                                                                  prefill, compile_, path, refused):
    """The check runs in a BEFORE hook on ``ModelRunner.init_cuda_graphs`` (it used to run once the scheduler existed,
    after the capture, where a GPU launch would die inside the capture with a traceback). Ragged mode captures its
    decode; the masking modes capture nothing. SGLang's graph configuration is stood in here (its function's name and
    phase/backend strings are SGLang 0.5.23's, test_api.py checks the hook's target)."""
    from types import SimpleNamespace

    from kvzap_export.integrations.sglang import server_setup

    on = {"decode": decode, "prefill": prefill}
    config = SimpleNamespace(check_cuda_graph_backend=lambda phase, backend: backend == "disabled" and not on[phase],
                             get_exec=lambda: SimpleNamespace(graph=SimpleNamespace(enable_torch_compile=compile_)),
                             get_parallel=lambda: SimpleNamespace(pp_size=1))
    monkeypatch.setenv("KVZAP_RAGGED_DECODE_KERNEL", path)
    monkeypatch.setattr(server_setup, "sglang_module", lambda name: config)
    monkeypatch.setattr(plugin, "_CONFIG", {"mode": mode})
    if refused is None:
        assert plugin._graphs_hook(object(), capture_decode_cuda_graph=True) is None
        return
    with pytest.raises(SystemExit) as info:
        plugin._graphs_hook(object(), capture_decode_cuda_graph=True)
    message = str(info.value)
    assert message.startswith(f"kvzap-export: KVzap ({mode} mode) cannot run on this SGLang server: {refused}")
    assert "\n" not in message and message.endswith("(stopped before the capture)")


@pytest.mark.parametrize("mode", ["ragged", "evict"])
@pytest.mark.parametrize("speculative, pp, refused", [
    (False, 1, None),
    (True, 1, "speculative decoding is on (drop --speculative-algorithm)"),
    (False, 2, "pipeline parallelism is 2 (use --pp-size 1)"),
])
def test_speculative_decoding_and_pipeline_parallelism_stop_the_launch_before_the_capture(clean, monkeypatch, mode,
                                                                                         speculative, pp, refused):
    """SGLang's model worker captures graphs and warms up (a draft worker's capture, the opt-in DeepGEMM warm-up's
    dummy forward under pipeline parallelism) before the scheduler exists, where ``ServerSetup`` would refuse these: the
    BEFORE hook on ``ModelRunner.init_cuda_graphs`` refuses them first, with the same words. The model runner and
    SGLang's context are stood in (plumbing; ``spec_algorithm.is_none()`` and ``get_parallel().pp_size`` are SGLang
    0.5.23's names, test_api.py checks the hook's target)."""
    from types import SimpleNamespace

    from kvzap_export.integrations.sglang import server_setup

    config = SimpleNamespace(check_cuda_graph_backend=lambda phase, backend: backend == "disabled",
                             get_exec=lambda: SimpleNamespace(graph=SimpleNamespace(enable_torch_compile=False)),
                             get_parallel=lambda: SimpleNamespace(pp_size=pp))
    monkeypatch.setattr(server_setup, "sglang_module", lambda name: config)
    monkeypatch.setattr(plugin, "_CONFIG", {"mode": mode})
    runner = SimpleNamespace(spec_algorithm=SimpleNamespace(is_none=lambda: not speculative))
    if refused is None:
        assert plugin._graphs_hook(runner) is None
        return
    with pytest.raises(SystemExit) as info:
        plugin._graphs_hook(runner)
    assert str(info.value) == f"kvzap-export: KVzap ({mode} mode) cannot run on this SGLang server: {refused} (stopped before the capture)"


def test_the_step_end_runs_on_the_forwards_stream_only_under_the_overlap_scheduler_on_a_gpu():
    """The step end is an AFTER hook on ``Scheduler.run_batch(batch)``: (result, scheduler, batch) in, the result kept.
    Under SGLang's overlap scheduler on a GPU the forward runs on ``scheduler.forward_stream``, so the step end's work is
    put on that stream and the scheduler's stream (where the next batch is prepared) waits for it; the normal loop, and the CPU engine's streams (no ``cuda_stream``), need no stream change. The
    scheduler and its streams are stood in (plumbing: the real ordering is tested in the engine, test_engine.py)."""
    import contextlib
    from types import SimpleNamespace

    entered, waited = [], []

    class Streams:
        @staticmethod
        @contextlib.contextmanager
        def stream(s):
            entered.append(s)
            yield

    cuda_stream = SimpleNamespace(cuda_stream=7)
    for overlap, stream, expected in ((True, cuda_stream, [cuda_stream]), (False, cuda_stream, []),
                                      (True, SimpleNamespace(), []), (True, None, [])):
        entered.clear(), waited.clear()
        scheduler = SimpleNamespace(enable_overlap=overlap, forward_stream=stream, device_module=Streams,
                                    schedule_stream=SimpleNamespace(wait_stream=waited.append))
        with plugin._in_forward_stream(scheduler):
            assert entered == expected
            assert waited == []  # the scheduler's stream waits after the step end's work, not before
        assert entered == expected and waited == expected, (overlap, stream)
    batch, scheduler = object(), object()
    assert plugin._ran_batch((scheduler, batch), {}) == (scheduler, batch)
    assert plugin._ran_batch((scheduler,), {"batch": batch}) == (scheduler, batch)
