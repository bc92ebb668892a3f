"""ONNX graphs of the compaction op: standard ops (TensorRT-friendly), the plugin node, and the K/V move.

``threshold_compaction`` uses no TopK and no NonZero: ``c = CumSum(keep)`` ranks kept tokens; a kept
token goes to ``c - 1``, an evicted one to ``count + t - c`` (a stable partition, hence a permutation
with no duplicate scatter indices); ``ScatterElements`` writes positions to their destinations and
positions past ``count`` become -1. CumSum runs in float32 (TensorRT's CumSum takes floats only): it is
exact for sequences below 2^24 tokens. ``threshold`` and ``window`` are graph inputs, so one engine
serves every threshold; ``sink`` is a constant of the graph (recorded in the manifest). Default opset
20 (18 and 19 work too). For float16/bfloat16 scores, τ is rounded to the scores' dtype and the
comparison made in float32, which is exact and equals kvpress's ``scores < threshold`` in that dtype.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kvzap_export.errors import ConfigError
from kvzap_export.export.dtypes import ONNX_DTYPES, canonical_dtype, check_opset, graph_io

PLUGIN_OP = "KVzapThresholdCompaction"
PLUGIN_NAMESPACE = "kvzap"
PLUGIN_VERSION = "1"
PLUGIN_DOMAIN = "ai.onnx.contrib"  # where onnxruntime-extensions registers Python ops; TensorRT ignores the domain

PATHS = {
    "threshold_compaction": "compaction/threshold_compaction.onnx",
    "threshold_compaction_plugin": "compaction/threshold_compaction_plugin.onnx",
    "kv_compaction": "compaction/kv_compaction.onnx",
}


def _const(name: str, value, dtype=np.int64) -> TensorProto:
    return numpy_helper.from_array(np.array(value, dtype=dtype), name)


def _io(dtype: str, heads: int):
    scores_t = ONNX_DTYPES[dtype]
    inputs = [
        helper.make_tensor_value_info("scores", scores_t, ["batch", heads, "seq"]),
        helper.make_tensor_value_info("lengths", TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info("threshold", TensorProto.FLOAT, []),
        helper.make_tensor_value_info("window", TensorProto.INT32, []),
    ]
    outputs = [
        helper.make_tensor_value_info("keep", TensorProto.BOOL, ["batch", heads, "seq"]),
        helper.make_tensor_value_info("counts", TensorProto.INT32, ["batch", heads]),
        helper.make_tensor_value_info("indices", TensorProto.INT32, ["batch", heads, "seq"]),
    ]
    return inputs, outputs


def threshold_compaction_graph(num_kv_heads: int, dtype: str = "float32", opset: int = 20, sink: int = 0) -> onnx.ModelProto:
    n = helper.make_node
    nodes = [
        n("Shape", ["scores"], ["shape"]),
        n("Gather", ["shape", "two"], ["seq"], axis=0),
        n("Range", ["zero", "seq", "one"], ["pos"]),  # int64 [T]
        n("Cast", ["lengths"], ["len64"], to=TensorProto.INT64),
        n("Unsqueeze", ["len64", "axes12"], ["limit"]),  # [B,1,1]
        n("Less", ["pos", "limit"], ["valid"]),
        n("Cast", ["window"], ["win64"], to=TensorProto.INT64),
        n("Sub", ["limit", "win64"], ["win_start"]),
        n("GreaterOrEqual", ["pos", "win_start"], ["in_window"]),
        n("Less", ["pos", "sink"], ["in_sink"]),
        n("Or", ["in_window", "in_sink"], ["protected"]),
    ]
    if dtype == "float32":
        nodes.append(n("Less", ["scores", "threshold"], ["below"]))
    else:
        # kvpress compares in the scores' dtype: round τ to it, then compare exactly in float32.
        nodes += [
            n("Cast", ["threshold"], ["tau_low"], to=ONNX_DTYPES[dtype]),
            n("Cast", ["tau_low"], ["tau"], to=TensorProto.FLOAT),
            n("Cast", ["scores"], ["scores_f"], to=TensorProto.FLOAT),
            n("Less", ["scores_f", "tau"], ["below"]),
        ]
    nodes += [
        n("Not", ["below"], ["not_below"]),
        n("Or", ["protected", "not_below"], ["kept_any"]),
        n("And", ["valid", "kept_any"], ["keep"]),
        n("Cast", ["keep"], ["keep_f"], to=TensorProto.FLOAT),
        n("CumSum", ["keep_f", "two"], ["rank_f"]),  # inclusive count of kept tokens up to t
        n("ReduceSum", ["keep_f", "axes2"], ["count_f"], keepdims=1),
        n("Cast", ["rank_f"], ["rank"], to=TensorProto.INT64),
        n("Cast", ["count_f"], ["count"], to=TensorProto.INT64),
        n("Sub", ["rank", "one"], ["dest_kept"]),
        n("Sub", ["pos", "rank"], ["evicted_rank"]),
        n("Add", ["count", "evicted_rank"], ["dest_evicted"]),
        n("Where", ["keep", "dest_kept", "dest_evicted"], ["dest"]),
        n("Shape", ["dest"], ["dest_shape"]),
        n("Expand", ["pos", "dest_shape"], ["pos_full"]),
        n("ScatterElements", ["pos_full", "dest", "pos_full"], ["perm"], axis=2),
        n("Less", ["pos", "count"], ["has_index"]),
        n("Where", ["has_index", "perm", "minus_one"], ["indices64"]),
        n("Cast", ["indices64"], ["indices"], to=TensorProto.INT32),
        n("Squeeze", ["count", "axes2"], ["count_sq"]),
        n("Cast", ["count_sq"], ["counts"], to=TensorProto.INT32),
    ]
    inits = [_const("zero", 0), _const("one", 1), _const("two", 2), _const("minus_one", -1), _const("sink", sink),
             _const("axes12", [1, 2]), _const("axes2", [2])]
    inputs, outputs = _io(dtype, num_kv_heads)
    graph = helper.make_graph(nodes, "kvzap_threshold_compaction", inputs, outputs, initializer=inits)
    return _model(graph, opset)


def plugin_graph(num_kv_heads: int, dtype: str = "float32", opset: int = 20, sink: int = 0) -> onnx.ModelProto:
    """The plugin node, then a Cast of its ``keep`` to bool.

    TensorRT maps the node to the plugin by op_type/version/namespace; ORT runs our custom op. TensorRT plugins
    cannot output bool (NvInferRuntime.h, ``IPluginV3OneBuild::getOutputDataTypes``) and its ONNX parser refuses
    an int32 tensor as a bool graph output, so the C++ plugin emits ``keep`` as int32 0/1 and the Cast gives the
    bool of the contract (a bool-emitting implementation, as ORT's custom op, goes through an identity Cast).
    """
    node = helper.make_node(PLUGIN_OP, ["scores", "lengths", "threshold", "window"], ["keep_plugin", "counts", "indices"],
                            domain=PLUGIN_DOMAIN, plugin_version=PLUGIN_VERSION, plugin_namespace=PLUGIN_NAMESPACE, sink=sink)
    cast = helper.make_node("Cast", ["keep_plugin"], ["keep"], to=TensorProto.BOOL)
    inputs, outputs = _io(dtype, num_kv_heads)
    graph = helper.make_graph([node, cast], "kvzap_threshold_compaction_plugin", inputs, outputs)
    return _model(graph, opset, extra=[helper.make_opsetid(PLUGIN_DOMAIN, 1)])


def kv_compaction_graph(num_kv_heads: int, head_dim: int, dtype: str = "float32", opset: int = 20) -> onnx.ModelProto:
    n = helper.make_node
    t = ONNX_DTYPES[dtype]
    nodes = [
        n("GreaterOrEqual", ["indices", "zero32"], ["valid"]),
        n("Where", ["valid", "indices", "zero32"], ["safe"]),
        n("Cast", ["safe"], ["safe64"], to=TensorProto.INT64),
        n("Unsqueeze", ["safe64", "last"], ["safe4"]),
        n("Shape", ["keys"], ["kshape"]),
        n("Expand", ["safe4", "kshape"], ["gather_idx"]),
        n("GatherElements", ["keys", "gather_idx"], ["k_g"], axis=2),
        n("GatherElements", ["values", "gather_idx"], ["v_g"], axis=2),
        n("Unsqueeze", ["valid", "last"], ["valid4"]),
        n("CastLike", ["zero_f", "keys"], ["zero_t"]),
        n("Where", ["valid4", "k_g", "zero_t"], ["keys_out"]),
        n("Where", ["valid4", "v_g", "zero_t"], ["values_out"]),
    ]
    shape = ["batch", num_kv_heads, "seq", head_dim]
    inputs = [helper.make_tensor_value_info("keys", t, shape), helper.make_tensor_value_info("values", t, shape),
              helper.make_tensor_value_info("indices", TensorProto.INT32, ["batch", num_kv_heads, "seq"])]
    outputs = [helper.make_tensor_value_info("keys_out", t, shape), helper.make_tensor_value_info("values_out", t, shape)]
    inits = [_const("zero32", 0, np.int32), _const("last", [-1]), _const("zero_f", 0.0, np.float32)]
    return _model(helper.make_graph(nodes, "kvzap_kv_compaction", inputs, outputs, initializer=inits), opset)


def _model(graph, opset: int, extra=()) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), *extra], producer_name="kvzap-export")
    model.ir_version = 9  # readable by ONNX Runtime >= 1.16 and TensorRT 10
    return model


def export_compaction_artifacts(out_dir: Path, num_kv_heads: int, head_dim: int, dtype: str = "float32", opset: int = 20,
                                sink: int = 0) -> list[dict]:
    """Writes the three compaction graphs under ``out_dir``; returns manifest artifact entries.

    ``dtype`` is the scores' (and K/V's) dtype: float32, float16 or bfloat16 (or fp32/fp16/bf16);
    ``opset`` 18, 19 or 20 (default 20, TensorRT 10 parses up to 20). Entries carry ``kind``, ``path``
    (relative to ``out_dir``) and ``inputs``/``outputs`` as ``{name: [dtype, shape]}`` with symbolic
    axes as strings; the bundle writer adds the digests. Bytes are deterministic for given arguments.
    """
    dtype, opset = canonical_dtype(dtype), check_opset(opset)
    for name, value, low in (("num_kv_heads", num_kv_heads, 1), ("head_dim", head_dim, 1), ("sink", sink, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
    models = {
        "threshold_compaction": threshold_compaction_graph(num_kv_heads, dtype, opset, sink),
        "threshold_compaction_plugin": plugin_graph(num_kv_heads, dtype, opset, sink),
        "kv_compaction": kv_compaction_graph(num_kv_heads, head_dim, dtype, opset),
    }
    artifacts = []
    for kind, model in models.items():
        if kind != "threshold_compaction_plugin":  # the checker rejects unregistered custom domains' ops
            onnx.checker.check_model(model, full_check=True)
        else:
            onnx.checker.check_model(model)
        target = Path(out_dir) / PATHS[kind]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(model.SerializeToString(deterministic=True))
        inputs, outputs = graph_io(model)
        entry = {"kind": kind, "path": PATHS[kind], "inputs": inputs, "outputs": outputs}
        if kind == "threshold_compaction_plugin":
            entry["plugin"] = {"name": PLUGIN_OP, "version": PLUGIN_VERSION, "namespace": PLUGIN_NAMESPACE, "sink": sink}
        artifacts.append(entry)
    return artifacts
