"""The SGLang plugin entry point: declared by the package, off without a bundle, fatal on a wrong setting,
and, with a real bundle, the hooks it registers and the runtime it builds.

SGLang's plugin loader is replaced by a recorder of ``HookRegistry.register`` calls (SGLang cannot be
installed here); the names the recorder stands for are checked against the real 0.5.23 source in
test_sglang_api.py.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvzap_export.integrations import sglang as glue


class FakeSGLangModules:
    """What ``glue._sglang(module)`` returns for the modules the plugin touches; records registrations."""

    def __init__(self):
        self.hooks: list[tuple[str, object, str]] = []
        self.backends: dict[str, object] = {}
        self.choices: list[str] = []

    def __call__(self, module: str):
        if module == "sglang.srt.plugins.hook_registry":
            register = lambda target, hook, hook_type: self.hooks.append((target, hook, hook_type))  # noqa: E731
            return SimpleNamespace(HookRegistry=SimpleNamespace(register=register),
                                   HookType=SimpleNamespace(BEFORE="before", AFTER="after"))
        if module == "sglang.srt.distributed.parallel_state":
            def get_tp_group():
                raise AssertionError("tensor model parallel group is not initialized")  # a plain process
            return SimpleNamespace(get_tp_group=get_tp_group)
        if module == "sglang.srt.layers.attention.attention_registry":
            def register_attention_backend(name):
                return lambda factory: self.backends.setdefault(name, factory)
            return SimpleNamespace(register_attention_backend=register_attention_backend)
        if module == "sglang.srt.arg_groups.choices":
            return SimpleNamespace(add_attention_backend_choices=self.choices.extend)
        if module == "sglang.srt.layers.attention.torch_flex_backend":
            class TorchFlexAttnBackend:  # __init__(self, model_runner), as in 0.5.23
                def __init__(self, model_runner):
                    self.model_runner = model_runner

            return SimpleNamespace(TorchFlexAttnBackend=TorchFlexAttnBackend)
        raise AssertionError(f"the plugin imported {module}, which this test does not stand in for")


@pytest.fixture
def fake_sglang(monkeypatch):
    fake = FakeSGLangModules()
    monkeypatch.setattr(glue, "_sglang", fake)
    monkeypatch.setattr(glue, "_CONFIG", None)
    monkeypatch.setattr(glue, "_RUNTIME", None)
    for name in ("KVZAP_BUNDLE", "KVZAP_MODE", "KVZAP_DECODING"):
        monkeypatch.delenv(name, raising=False)
    return fake


def test_entry_point_is_declared_by_the_package():
    """Installing kvzap-export next to SGLang is enough: SGLang finds the plugin by this group."""
    found = [ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins") if ep.name == "kvzap"]
    assert len(found) == 1, "kvzap-export is not installed with its entry points (pip install -e .)"
    assert found[0].value == "kvzap_export.integrations.sglang:load_plugin"
    assert found[0].load() is glue.load_plugin


def test_plugin_is_off_without_a_bundle(fake_sglang):
    assert glue.load_plugin() is None
    assert fake_sglang.hooks == [] and glue._CONFIG is None


def test_plugin_without_sglang_stops_with_one_line(monkeypatch, tmp_path):
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    monkeypatch.setattr(glue, "_CONFIG", None)
    monkeypatch.setenv("KVZAP_BUNDLE", str(tmp_path))
    with pytest.raises(SystemExit) as info:
        glue.load_plugin()
    message = str(info.value.code)
    assert "\n" not in message and "pip install sglang==0.5.23" in message
    assert "sglang" not in sys.modules and glue._CONFIG is None


@pytest.mark.parametrize("env, named", [
    ({"KVZAP_BUNDLE": "{tmp}/missing"}, "not a bundle directory"),
    ({"KVZAP_BUNDLE": "{tmp}"}, "no manifest.json"),
    ({"KVZAP_BUNDLE": "{tmp}", "KVZAP_DECODING": "yes"}, "KVZAP_DECODING='yes'"),
    ({"KVZAP_BUNDLE": "{tmp}", "KVZAP_MODE": "drop"}, "mode 'drop'"),
])
def test_plugin_stops_on_a_wrong_setting_instead_of_serving_without_kvzap(fake_sglang, monkeypatch, tmp_path, env, named):
    """SGLang logs and ignores a plugin's exception; SystemExit is not an Exception, so the launch stops."""
    for key, value in env.items():
        monkeypatch.setenv(key, value.format(tmp=tmp_path))
    with pytest.raises(SystemExit) as info:
        glue.load_plugin()
    message = str(info.value.code)
    assert message.startswith("kvzap-export: ") and named in message and "\n" not in message
    assert fake_sglang.hooks == [] and glue._CONFIG is None


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    """A real bundle of the embedded model (shipped MLP surrogate), as ``kvzap-export`` writes it."""
    from kvzap_export.pipeline import ExportOptions, run_pipeline

    out = tmp_path_factory.mktemp("sglang-plugin") / "bundle"
    run_pipeline(ExportOptions(model="smollm2-135m", out=out, check=False))
    return out


@pytest.mark.slow
def test_plugin_registers_evict_hooks_and_builds_the_runtime_from_the_bundle(fake_sglang, monkeypatch, bundle):
    from kvzap_export.bundle.manifest import read_manifest
    from kvzap_export.surrogate import load_surrogate

    monkeypatch.setenv("KVZAP_BUNDLE", str(bundle))
    monkeypatch.setenv("KVZAP_DECODING", "0")
    glue.load_plugin()
    registered = {(target, kind) for target, _, kind in fake_sglang.hooks}
    assert registered == {
        ("sglang.srt.models.llama.LlamaAttention.forward", "before"),
        ("sglang.srt.models.qwen3.Qwen3Attention.forward", "before"),
        ("sglang.srt.managers.scheduler.Scheduler.process_batch_result", "before"),
        ("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new", "after"),
    }
    assert fake_sglang.backends == {}

    runtime = glue.runtime()  # what the first hook call builds in a scheduler process
    pruning = read_manifest(bundle)["pruning"]
    assert runtime.mode == "evict" and runtime.policy.layout == "uniform" and runtime.policy.decoding is False
    assert (runtime.policy.threshold, runtime.policy.window, runtime.policy.sink) == (
        pruning["threshold"], pruning["window"], pruning["sink"])
    assert (runtime.scorer.num_layers, runtime.scorer.num_kv_heads) == (30, 3) and runtime.tp_group is None
    hidden = torch.randn(5, 576, generator=torch.Generator().manual_seed(0))
    reference = load_surrogate(bundle / "surrogate")
    with torch.no_grad():
        assert torch.equal(runtime.scorer.score(7, hidden), reference.layers[7](hidden))
    assert glue.runtime() is runtime


@pytest.mark.slow
def test_plugin_mask_mode_registers_the_flex_backend(fake_sglang, monkeypatch, bundle):
    monkeypatch.setenv("KVZAP_BUNDLE", str(bundle))
    monkeypatch.setenv("KVZAP_MODE", "mask")
    glue.load_plugin()
    targets = {target for target, _, _ in fake_sglang.hooks}
    assert "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new" not in targets  # positions stay
    assert fake_sglang.choices == [glue.BACKEND_NAME] and set(fake_sglang.backends) == {glue.BACKEND_NAME}
    runner = object()
    backend = fake_sglang.backends[glue.BACKEND_NAME](runner)
    assert type(backend).__name__ == "KVzapFlexAttnBackend" and type(backend).__mro__[1].__name__ == "TorchFlexAttnBackend"
    assert backend.model_runner is runner
    assert glue.runtime().policy.layout == "ragged"


@pytest.mark.slow
def test_install_takes_policy_overrides_and_refuses_bad_ones(fake_sglang, bundle):
    from kvzap_export.errors import ConfigError

    glue.install(bundle, threshold=-5.5, window=64)
    assert (glue.runtime().policy.threshold, glue.runtime().policy.window) == (-5.5, 64)
    with pytest.raises(ConfigError, match="window must be a non-negative integer"):
        glue.install(bundle, window=-1)
