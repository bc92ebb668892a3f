"""The TensorRT runner against a stand-in TensorRT that enforces what the real one does with shapes.

TensorRT cannot be installed here, so ``tensorrt`` is replaced by a small fake written from TensorRT's documented
behaviour: ``set_input_shape`` returns False (and records nothing) for a shape of the wrong rank, a fixed dimension
that differs, or a dynamic one outside the optimization profile; ``execute_async_v3`` returns False until every
input has a shape. The fake "engine" computes the compaction with the PyTorch reference on the buffers the runner
hands over (CPU memory here, where the real runner uses CUDA memory). This is a plumbing check of the runner —
names, shapes, dtypes, addresses, return values — not a parity check: the only computation is the reference.
"""

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvzap_export.errors import InputError
from kvzap_export.ops import threshold_compaction
from kvzap_export.runners import trt as trt_runner

NUMPY_OF = {"FLOAT": np.float32, "BF16": np.uint16, "INT32": np.int32, "BOOL": np.bool_}
INPUT, OUTPUT = "INPUT", "OUTPUT"


class DataType(SimpleNamespace):
    pass


FLOAT, BF16, INT32, BOOL = (DataType(name=n) for n in ("FLOAT", "BF16", "INT32", "BOOL"))


def _view(pointer: int, dtype: DataType, shape: tuple) -> np.ndarray:
    """A numpy view of ``shape`` elements of ``dtype`` at a raw address (what a kernel would read or write)."""
    np_dtype = np.dtype(NUMPY_OF[dtype.name])
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    raw = (ctypes.c_char * (count * np_dtype.itemsize)).from_address(pointer)
    return np.frombuffer(raw, dtype=np_dtype, count=count).reshape(shape)


class FakeEngine:
    """tensors: {name: (mode, DataType, shape with -1, (min, max) per dimension)}; compute: the engine's function."""

    def __init__(self, tensors: dict, compute):
        self.tensors, self.compute = tensors, compute
        self.num_io_tensors = len(tensors)

    def get_tensor_name(self, index):
        return list(self.tensors)[index]

    def get_tensor_mode(self, name):
        return self.tensors[name][0]

    def get_tensor_dtype(self, name):
        return self.tensors[name][1]

    def get_tensor_shape(self, name):
        return tuple(self.tensors[name][2])

    def create_execution_context(self):
        return FakeContext(self)


class FakeContext:
    def __init__(self, engine: FakeEngine):
        self.engine, self.shapes, self.addresses = engine, {}, {}

    def set_input_shape(self, name, shape):
        _mode, _dtype, dims, ranges = self.engine.tensors[name]
        shape = tuple(shape)
        if len(shape) != len(dims):
            return False
        for size, dim, (low, high) in zip(shape, dims, ranges):
            if (dim >= 0 and size != dim) or not low <= size <= high:
                return False
        self.shapes[name] = shape
        return True

    def set_tensor_address(self, name, pointer):
        self.addresses[name] = pointer
        return True

    def _inputs(self):
        return [n for n, t in self.engine.tensors.items() if t[0] == INPUT]

    def get_tensor_shape(self, name):
        if self.engine.tensors[name][0] == INPUT:
            return self.shapes.get(name, self.engine.get_tensor_shape(name))
        if any(n not in self.shapes for n in self._inputs()):
            return tuple(-1 for _ in self.engine.tensors[name][2])
        return self.engine.compute.shapes(self.shapes)[name]

    def execute_async_v3(self, stream):
        if any(n not in self.shapes or n not in self.addresses for n in self._inputs()):
            return False
        inputs = {n: _view(self.addresses[n], self.engine.tensors[n][1], self.shapes[n]) for n in self._inputs()}
        for name, value in self.engine.compute(inputs).items():
            out = _view(self.addresses[name], self.engine.tensors[name][1], self.get_tensor_shape(name))
            out[...] = value
        return True


class Compaction:
    """The threshold-compaction engine's function, computed by the reference."""

    @staticmethod
    def shapes(shapes):
        batch, heads, seq = shapes["scores"]
        return {"keep": (batch, heads, seq), "counts": (batch, heads), "indices": (batch, heads, seq)}

    def __call__(self, inputs):
        result = threshold_compaction(torch.from_numpy(inputs["scores"].copy()), torch.from_numpy(inputs["lengths"].copy()),
                                      float(inputs["threshold"]), int(inputs["window"]))
        return {name: value.numpy() for name, value in result._asdict().items()}


def _fake_tensorrt(engine: FakeEngine) -> SimpleNamespace:
    registry = SimpleNamespace(load_library=lambda path: object())
    runtime = SimpleNamespace(deserialize_cuda_engine=lambda plan: engine)
    return SimpleNamespace(
        Logger=type("Logger", (), {"WARNING": 2, "__init__": lambda self, level: None}),
        Runtime=lambda logger: runtime, get_plugin_registry=lambda: registry,
        TensorIOMode=SimpleNamespace(INPUT=INPUT, OUTPUT=OUTPUT), DataType=SimpleNamespace(BF16=BF16))


COMPACTION = {
    "scores": (INPUT, FLOAT, (-1, 2, -1), ((1, 4), (2, 2), (1, 64))),
    "lengths": (INPUT, INT32, (-1,), ((1, 4),)),
    "threshold": (INPUT, FLOAT, (), ()),
    "window": (INPUT, INT32, (), ()),
    "keep": (OUTPUT, BOOL, (-1, 2, -1), ()),
    "counts": (OUTPUT, INT32, (-1, 2), ()),
    "indices": (OUTPUT, INT32, (-1, 2, -1), ()),
}


@pytest.fixture
def runner(monkeypatch, tmp_path):
    """A TrtRunner over a fake compaction engine, its buffers in CPU memory."""
    def make(tensors=COMPACTION, compute=Compaction()):
        monkeypatch.setattr(trt_runner, "import_tensorrt", lambda: (_fake_tensorrt(FakeEngine(tensors, compute)), None))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda: SimpleNamespace(cuda_stream=0, synchronize=lambda: None))
        (tmp_path / "e.plan").write_bytes(b"plan")
        made = trt_runner.TrtRunner(tmp_path / "e.plan")
        made.device = "cpu"
        return made
    return make


def _feed(batch=2, seq=40):
    gen = torch.Generator().manual_seed(0)
    return {"scores": torch.randn(batch, 2, seq, generator=gen).numpy(), "lengths": np.array([seq, seq // 2][:batch], np.int32),
            "threshold": np.array(0.1, np.float32), "window": np.array(8, np.int32)}


def test_scalar_inputs_stay_scalars_and_the_engine_runs(runner):
    """threshold and window are 0-d: TensorRT refuses them as shape (1,), and then refuses to execute."""
    feed = _feed()
    with runner() as trt:
        assert trt.get_input_metadata()["threshold"] == ("float32", []) and trt.get_input_metadata()["window"] == ("int32", [])
        got = trt.infer(feed)
    ref = threshold_compaction(torch.from_numpy(feed["scores"]), torch.from_numpy(feed["lengths"]), 0.1, 8)
    assert list(got) == ["keep", "counts", "indices"] and got["keep"].dtype == np.bool_
    for name, value in ref._asdict().items():
        np.testing.assert_array_equal(got[name], value.numpy())


def test_a_shape_tensorrt_refuses_is_one_clear_error(runner):
    with runner() as trt:
        with pytest.raises(InputError, match=r"refused input scores of shape \[2, 2, 65\].*\[-1, 2, -1\]"):
            trt.infer(_feed(seq=65))  # past the profile's maximum sequence


def test_bfloat16_tensors_are_fed_as_float32_and_come_back_widened(runner):
    """A bf16 engine: numpy has no bfloat16, so the runner casts on the device and widens the outputs exactly."""
    tensors = {"x": (INPUT, BF16, (-1, 4), ((1, 8), (4, 4))), "y": (OUTPUT, BF16, (-1, 4), ())}

    class Double:
        @staticmethod
        def shapes(shapes):
            return {"y": shapes["x"]}

        def __call__(self, inputs):
            x = torch.from_numpy(inputs["x"].view(np.int16).copy()).view(torch.bfloat16)
            return {"y": (x * 2).view(torch.int16).numpy().view(np.uint16)}

    x = np.array([[1.0, 1.00390625, -3.5, 1e-3]], np.float32)  # 1.00390625 rounds to 1.0 in bf16
    with runner(tensors, Double()) as trt:
        assert trt.get_input_metadata() == {"x": ("float32", ["dim0", 4])}
        y = trt.infer({"x": x})["y"]
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, (torch.from_numpy(x).to(torch.bfloat16) * 2).float().numpy())
