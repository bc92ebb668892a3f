"""The Python (``tensorrt.plugin``) AOT plugin: what it registers and how ``kvzap-export build`` reaches it.

TensorRT cannot be installed here, so ``tensorrt`` and ``tensorrt.plugin`` are stand-ins that record what the
project asks of them (the real names are checked against TensorRT 11.4 in tests/trt/test_trt_api_names.py). These
are plumbing checks: plugin id, implementations registered, the PTX target, launch parameters, network flags, the
graph handed to the parser. The PTX itself is compiled and assembled by the tests of test_triton_compaction.py.
"""

import sys
from types import ModuleType, SimpleNamespace

import onnx
import pytest

from kvzap_export.errors import ConfigError, MissingDependencyError
from kvzap_export.export.compaction_onnx import PLUGIN_NAMESPACE, PLUGIN_OP, plugin_graph
from kvzap_export.kernels import triton_compaction, trt_plugin
from kvzap_export.trt import builder


class FakePlugin(ModuleType):
    """``tensorrt.plugin``: decorators record the functions; shape expressions are plain ints."""

    def __init__(self):
        super().__init__("tensorrt.plugin")
        self.registered, self.aot, self.jit = {}, {}, {}
        self.TensorDesc = self.Tensor = self.SymExprs = object
        self.KernelLaunchParams = lambda: SimpleNamespace()
        self.SymIntExprs = lambda n: [None] * n
        self.SymInt32 = lambda expr: ("i32", expr)
        self.cdiv = lambda a, b: -(-a // b)
        self.max = max
        self.from_shape_expr = lambda shape, dtype: SimpleNamespace(shape=tuple(shape), dtype=dtype)

    def _recorder(self, table):
        def decorator_for(plugin_id):
            def decorator(function):
                table[plugin_id] = function
                return function
            return decorator
        return decorator_for

    def __getattr__(self, name):
        tables = {"register": "registered", "aot_impl": "aot", "impl": "jit"}
        if name in tables:
            return self._recorder(self.__dict__[tables[name]])
        raise AttributeError(name)


@pytest.fixture
def fake_tensorrt(monkeypatch):
    trtp = FakePlugin()
    trt = ModuleType("tensorrt")
    trt.__version__ = "11.4.0.106"
    for name in ("float32", "float16", "bfloat16", "int32", "int64", "bool"):
        setattr(trt, name, f"DataType.{name}")
    trt.QuickPluginCreationRequest = SimpleNamespace(STRICT_AOT=0)
    trt.plugin = trtp
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    monkeypatch.setattr(trt_plugin, "_registered", False)
    monkeypatch.setattr(triton_compaction, "require_triton", lambda: None)
    return trt, trtp


def test_registers_an_aot_implementation_only_under_its_own_namespace(fake_tensorrt):
    trt, trtp = fake_tensorrt
    plugin_id = trt_plugin.register_plugin()
    assert plugin_id == "kvzap_aot::KVzapThresholdCompaction" != f"{PLUGIN_NAMESPACE}::{PLUGIN_OP}"  # the C++ plugin's
    assert list(trtp.registered) == [plugin_id] and list(trtp.aot) == [plugin_id]
    assert trtp.jit == {}  # no Python callback: nothing for TensorRT to choose between
    assert trt_plugin.register_plugin() == plugin_id and len(trtp.registered) == 1  # once per process
    desc = SimpleNamespace(shape_expr=(2, 3, 700), dtype=trt.bfloat16)
    keep, counts, indices = trtp.registered[plugin_id](desc, None, None, None, 0)
    assert keep.shape == indices.shape == (2, 3, 700) and counts.shape == (2, 3) and keep.dtype == trt.int32


def test_the_aot_kernel_targets_portable_ptx_with_the_launch_the_kernel_expects(fake_tensorrt, monkeypatch):
    trt, trtp = fake_tensorrt
    asked = {}

    def compile_stub(scores_dtype, sink, arch=None, **dtypes):
        asked.update(scores=scores_dtype, sink=sink, arch=arch, **dtypes)
        return SimpleNamespace(metadata=SimpleNamespace(name="compaction_kernel", num_warps=8, shared=64), asm={})

    monkeypatch.setattr(trt_plugin, "compile_compaction_kernel", compile_stub)
    monkeypatch.setattr(trt_plugin, "ptx_for_tensorrt", lambda compiled: "PTX")
    aot = trtp.aot[trt_plugin.register_plugin()]
    scores = SimpleNamespace(shape_expr=(2, 3, 700), dtype=trt.bfloat16)
    lengths, threshold, window = (SimpleNamespace(dtype=d) for d in (trt.int32, trt.float32, trt.int32))
    name, ptx, launch, extra = aot(scores, lengths, threshold, window, 4, (), 0)
    assert asked == {"scores": "bfloat16", "sink": 4, "arch": trt_plugin.PTX_ARCH, "lengths_dtype": "int32",
                     "threshold_dtype": "float32", "window_dtype": "int32"}
    assert trt_plugin.PTX_ARCH == 80  # the build GPU plays no part: sm_80 PTX runs, compiled forward, on any later GPU
    config = triton_compaction.compaction_config(700, triton_compaction.BLOCK_T, triton_compaction.CHUNK_T)
    assert (name, ptx) == ("compaction_kernel", "PTX") and launch.grid_x == config.programs(2, 3, 700)
    assert launch.block_x == 8 * 32 and launch.shared_mem == 64 and extra == [("i32", 700), ("i32", 3)]
    with pytest.raises(ValueError, match="no kernel"):
        aot(SimpleNamespace(shape_expr=(1, 1, 1), dtype="DataType.fp8"), lengths, threshold, window, 0, (), 0)


def test_without_aot_support_the_error_says_what_to_install(fake_tensorrt):
    trt, _ = fake_tensorrt
    del trt.QuickPluginCreationRequest
    with pytest.raises(MissingDependencyError, match="no AOT Python plugins"):
        trt_plugin.register_plugin()


def test_the_builder_hands_tensorrt_the_plugin_node_under_the_python_plugins_namespace():
    model = plugin_graph(2, "float32", 20, sink=3)
    retargeted = trt_plugin.python_plugin_graph(model)
    node = next(n for n in retargeted.graph.node if n.op_type == PLUGIN_OP)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["plugin_namespace"] == trt_plugin.QDP_NAMESPACE.encode() and attrs["sink"] == 3
    assert attrs["plugin_version"] == b"1"
    original = next(n for n in model.graph.node if n.op_type == PLUGIN_OP)  # the bundle's graph is left alone
    assert onnx.helper.get_attribute_value(next(a for a in original.attribute if a.name == "plugin_namespace")) == b"kvzap"


def test_network_flags_ask_for_strong_typing_and_for_the_aot_plugin_when_used():
    flags = SimpleNamespace(STRONGLY_TYPED=1, PREFER_AOT_PYTHON_PLUGINS=4)  # bit positions differ across versions
    trt = SimpleNamespace(NetworkDefinitionCreationFlag=flags)
    assert builder.network_flags(trt, python_plugin=False) == 1 << 1
    assert builder.network_flags(trt, python_plugin=True) == (1 << 1) | (1 << 4)


def test_build_one_parses_the_retargeted_graph_with_the_aot_flag(tmp_path):
    """_build_one against a stand-in TensorRT: which flags the network gets and which bytes the parser reads."""
    path = tmp_path / "plugin.onnx"
    onnx.save(plugin_graph(2, "float32", 20), str(path))
    seen = {}

    class Parser:
        num_errors = 0

        def __init__(self, network, logger):
            pass

        def parse(self, data):
            seen["parsed"] = onnx.load_from_string(data)
            return True

        def parse_from_file(self, name):
            seen["file"] = name
            return True

    cleared = []
    config = SimpleNamespace(set_memory_pool_limit=lambda *a: None, create_timing_cache=lambda b: object(),
                             clear_flag=cleared.append,
                             set_timing_cache=lambda cache, ignore_mismatch: True, add_optimization_profile=lambda p: None,
                             get_timing_cache=lambda: SimpleNamespace(serialize=lambda: b"cache"))
    network_builder = SimpleNamespace(
        create_network=lambda flags: seen.setdefault("flags", flags), create_builder_config=lambda: config,
        create_optimization_profile=lambda: SimpleNamespace(set_shape=lambda *a: None),
        build_serialized_network=lambda network, cfg: b"plan")
    trt = SimpleNamespace(Builder=lambda logger: network_builder, OnnxParser=Parser,
                          NetworkDefinitionCreationFlag=SimpleNamespace(STRONGLY_TYPED=0, PREFER_AOT_PYTHON_PLUGINS=3),
                          MemoryPoolType=SimpleNamespace(WORKSPACE=0), BuilderFlag=SimpleNamespace(TF32="tf32"),
                          __version__="11.4.0.106")
    options = builder.BuildOptions(python_plugin=True)
    plan, cache = builder._build_one(trt, None, path, "plugin.onnx", {}, options, None, plugin=True)
    assert (plan, cache) == (b"plan", b"cache") and seen["flags"] == 0b1001 and "file" not in seen
    assert cleared == ["tf32"]  # float32 graphs built in float32, not TF32 (the validation's bound)
    node = next(n for n in seen["parsed"].graph.node if n.op_type == PLUGIN_OP)
    assert any(a.name == "plugin_namespace" and a.s == trt_plugin.QDP_NAMESPACE.encode() for a in node.attribute)
    seen.clear()
    builder._build_one(trt, None, path, "plugin.onnx", {}, builder.BuildOptions(plugin_libraries=("lib.so",)), None,
                       plugin=True)
    assert seen == {"flags": 1, "file": str(path)}  # the C++ library: the bundle's file as it is


def test_python_plugin_and_plugin_library_are_exclusive():
    with pytest.raises(ConfigError, match="--python-plugin and --plugin-lib"):
        builder.BuildOptions(python_plugin=True, plugin_libraries=("lib.so",))
