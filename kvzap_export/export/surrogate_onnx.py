"""ONNX export of the per-layer surrogates.

Every layer has the same graph; only the weights differ. We export one layer with
``torch.onnx.export`` (dynamo), then bind each layer's weights into a copy of that graph by
initializer name. That is exact (same ops, same order) and turns a 64-layer export from minutes
into seconds. Weights are cast to the activation dtype first, as kvpress does at run time.

Graph contract (DESIGN.md): ``hidden_states`` [num_tokens, hidden_size] -> ``scores``
[num_tokens, num_kv_heads], ``num_tokens`` dynamic; weights embedded (each layer is far below 2 GB).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Callable
from pathlib import Path

import onnx
import torch

from kvzap_export.export.dtypes import TORCH_DTYPES
from kvzap_export.surrogate.model import Surrogate, make_layer

INPUT_NAME = "hidden_states"
OUTPUT_NAME = "scores"
TOKENS_DIM = "num_tokens"


def layer_path(layer: int) -> str:
    return f"onnx/surrogate_layer_{layer:03d}.onnx"


@contextlib.contextmanager
def _quiet_exporter():
    """torch.onnx logs warnings about unrelated libraries (torchvision ops); users need none of it."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def export_template(surrogate: Surrogate, dtype: str, opset: int) -> onnx.ModelProto:
    """Exports one layer's graph; its weight initializers are named by state-dict key."""
    module = make_layer(surrogate.config).to(TORCH_DTYPES[dtype]).eval()
    sample = torch.zeros(3, surrogate.config.input_dim, dtype=TORCH_DTYPES[dtype])
    with _quiet_exporter(), torch.no_grad():
        program = torch.onnx.export(
            module,
            (sample,),
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_shapes=({0: torch.export.Dim(TOKENS_DIM, min=1)},),
            opset_version=opset,
            dynamo=True,
            external_data=False,
            verbose=False,
        )
    model = program.model_proto
    names = {init.name for init in model.graph.initializer}
    missing = set(module.state_dict()) - names
    if missing:  # the exporter renamed or folded a weight: binding by name would be wrong
        raise RuntimeError(f"exported surrogate graph lacks weight initializers {sorted(missing)}")
    _name_symbolic_dims(model)
    return model


def _name_symbolic_dims(model: onnx.ModelProto) -> None:
    for value in list(model.graph.input) + list(model.graph.output):
        dim = value.type.tensor_type.shape.dim[0]
        dim.ClearField("dim_value")
        dim.dim_param = TOKENS_DIM


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    tensor = tensor.detach().contiguous().cpu()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy().tobytes()


def bind_layer(template: onnx.ModelProto, surrogate: Surrogate, layer: int, dtype: str) -> onnx.ModelProto:
    """A copy of ``template`` carrying ``layer``'s weights, cast to ``dtype``."""
    model = copy.deepcopy(template)
    state = surrogate.layers[layer].state_dict()
    for init in model.graph.initializer:
        if init.name in state:
            value = state[init.name].to(TORCH_DTYPES[dtype])
            if list(init.dims) != list(value.shape):
                raise RuntimeError(f"initializer {init.name}: graph shape {list(init.dims)} != weight {list(value.shape)}")
            init.ClearField("float_data")
            init.ClearField("int32_data")
            init.raw_data = _tensor_bytes(value)
    model.graph.name = f"kvzap_surrogate_layer_{layer}"
    meta = {"kvzap.layer": str(layer), "kvzap.variant": surrogate.config.variant, "kvzap.dtype": dtype}
    del model.metadata_props[:]
    for key, val in meta.items():
        model.metadata_props.add(key=key, value=val)
    return model


def io_spec(surrogate: Surrogate, dtype: str) -> tuple[dict, dict]:
    cfg = surrogate.config
    return (
        {INPUT_NAME: [dtype, [TOKENS_DIM, cfg.input_dim]]},
        {OUTPUT_NAME: [dtype, [TOKENS_DIM, cfg.output_dim]]},
    )


def export_surrogate(
    surrogate: Surrogate,
    out_dir: Path,
    dtype: str = "float32",
    opset: int = 20,
    on_layer: Callable[[int], None] | None = None,
) -> list[dict]:
    """Writes one checked ONNX file per layer under ``out_dir``; returns manifest artifact entries."""
    template = export_template(surrogate, dtype, opset)
    inputs, outputs = io_spec(surrogate, dtype)
    artifacts = []
    for layer in range(surrogate.config.n_modules):
        model = bind_layer(template, surrogate, layer, dtype)
        onnx.checker.check_model(model, full_check=True)
        relative = layer_path(layer)
        target = out_dir / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(model.SerializeToString(deterministic=True))
        artifacts.append({"kind": "surrogate_layer", "path": relative, "layer": layer, "inputs": inputs, "outputs": outputs})
        if on_layer is not None:
            on_layer(layer)
    return artifacts
