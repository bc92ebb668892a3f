"""The one dtype table (kvzap_export/export/dtypes.py): its contents, and no second name -> torch dtype table."""

import ast
from pathlib import Path

import pytest
import torch
from onnx import TensorProto, helper

from kvzap_export.errors import ConfigError
from kvzap_export.export.dtypes import ACTIVATION_DTYPES, ONNX_DTYPES, TORCH_DTYPES, canonical_dtype, graph_io

ROOT = Path(__file__).resolve().parents[2]
# A second table another change (issue 19, validate/) removes; drop the entry then.
KNOWN_ELSEWHERE = {"kvzap_export/validate/compaction_checks.py"}


def test_every_dtype_name_has_its_torch_and_onnx_type():
    assert set(TORCH_DTYPES) == set(ONNX_DTYPES) and set(ACTIVATION_DTYPES) <= set(TORCH_DTYPES)
    for name, dtype in TORCH_DTYPES.items():
        assert str(dtype) == f"torch.{name}"
        assert helper.tensor_dtype_to_np_dtype(ONNX_DTYPES[name]).name == name


def test_activation_dtypes_and_aliases():
    assert canonical_dtype("bf16") == "bfloat16" and canonical_dtype("FP32") == "float32"
    with pytest.raises(ConfigError, match="use one of \\['bfloat16', 'float16', 'float32'\\]"):
        canonical_dtype("int32")  # a tensor dtype of the bundle, not one a model runs in


def test_graph_io_names_dtypes_and_symbolic_dims():
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["n", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, ["n", 4])])
    assert graph_io(helper.make_model(graph)) == ({"x": ["bfloat16", ["n", 4]]}, {"y": ["bfloat16", ["n", 4]]})
    odd = helper.make_model(helper.make_graph([], "g", [helper.make_tensor_value_info("x", TensorProto.UINT8, [2])], []))
    assert graph_io(odd)[0] == {"x": [str(TensorProto.UINT8), [2]]}  # unknown: its number, for verify to report


def _torch_dtype_tables(path: Path) -> int:
    """Dict literals in one file that map names (ours, or another library's such as TensorRT's "BF16") to
    ``torch.<dtype>`` values: two entries or more."""
    found = 0
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Dict):
            pairs = [(k, v) for k, v in zip(node.keys, node.values)
                     if isinstance(k, ast.Constant) and isinstance(k.value, str) and isinstance(v, ast.Attribute)
                     and isinstance(v.value, ast.Name) and v.value.id == "torch"
                     and isinstance(getattr(torch, v.attr, None), torch.dtype)]
            found += len(pairs) >= 2
    return found


def test_one_table_maps_dtype_names_to_torch_dtypes():
    tables = {p.relative_to(ROOT).as_posix(): n for p in sorted([*ROOT.glob("kvzap_export/**/*.py"), *ROOT.glob("scripts/*.py")])
              if (n := _torch_dtype_tables(p))}
    assert tables.pop("kvzap_export/export/dtypes.py") == 1
    assert set(tables) <= KNOWN_ELSEWHERE, f"dtype tables besides export/dtypes.py: {sorted(set(tables) - KNOWN_ELSEWHERE)}"
