"""The engine modules import without their engines; engine-bound pieces then fail with one clear line."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from kvzap_export.errors import MissingDependencyError

ENGINES = {"trtllm": "tensorrt_llm", "sglang": "sglang"}
SGLANG_MODULES = tuple(f"kvzap_export.integrations.sglang.{m}" for m in (
    "api", "driver", "masking", "plugin", "ragged", "runtime", "server_setup", "stats"))


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_import_without_engine(name):
    if importlib.util.find_spec(ENGINES[name]) is not None:
        pytest.skip(f"{ENGINES[name]} is installed here")
    modules = SGLANG_MODULES if name == "sglang" else (f"kvzap_export.integrations.{name}",)
    code = (f"import sys, importlib; [importlib.import_module(m) for m in {list(modules)!r}]; "
            f"assert {ENGINES[name]!r} not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def _calls():
    from kvzap_export.integrations import trtllm
    from kvzap_export.integrations.sglang import masking, ragged, ragged_pool, server_setup

    return {
        "sglang.masking.native_backend_class": lambda: masking.native_backend_class(None),
        "sglang.masking.flex_backend_class": lambda: masking.flex_backend_class(None),
        "sglang.ragged.backend_class": lambda: ragged.backend_class(ragged.RaggedParts()),
        "sglang.ragged_pool.placeholder_pool_class": ragged_pool.placeholder_pool_class,
        "sglang.server_setup.ServerSetup.of": lambda: server_setup.ServerSetup.of(None),
        "trtllm.install": lambda: trtllm.install("."),
        "trtllm.install_sparse_kv": lambda: trtllm.install_sparse_kv(".", keep_fraction=0.5),
        "trtllm.compression_manager_class": trtllm.compression_manager_class,
        "trtllm.compression_config": trtllm.compression_config,
        "trtllm.attach_scorer(model)": lambda: trtllm.attach_scorer(__import__("torch").nn.Linear(2, 2), None),
    }


@pytest.mark.parametrize("call", sorted(_calls()))
def test_use_without_engine_is_one_line(call):
    engine = ENGINES[call.split(".")[0]]
    if importlib.util.find_spec(engine) is not None:
        pytest.skip(f"{engine} is installed here")
    with pytest.raises(MissingDependencyError) as info:
        _calls()[call]()
    message = str(info.value)
    assert "\n" not in message and engine in message and "pip install" in message


def test_missing_engine_vs_broken_engine(tmp_path, monkeypatch):
    from kvzap_export.integrations._lazy import import_engine

    with pytest.raises(MissingDependencyError, match=r"needs no_such_engine_pkg .* pip install x"):
        import_engine("no_such_engine_pkg.sub", "feature", "pip install x")
    # An engine that is installed but whose own dependency is missing keeps its traceback.
    (tmp_path / "broken_engine_pkg").mkdir()
    (tmp_path / "broken_engine_pkg" / "__init__.py").write_text("import no_such_dependency_of_the_engine\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_of_the_engine"):
        import_engine("broken_engine_pkg", "feature", "pip install x")
