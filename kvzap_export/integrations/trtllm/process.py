"""What KVzap's TensorRT-LLM glue holds per process: the scorer and mapping ``install`` set up, the targets, and
the one guarded import of TensorRT-LLM."""

from __future__ import annotations

from kvzap_export.errors import ConfigError
from kvzap_export.integrations._lazy import import_engine

TRTLLM_SPARSE_VERSION = "1.2.1"
TRTLLM_COMPRESSION_TARGET = "main after v1.2.1 (KV-cache compression framework)"
INSTALL = ("TensorRT-LLM on a CUDA machine, from NVIDIA's index: pip install tensorrt-llm==1.2.1 "
           "(sparse_kv_predict variant) or a main-branch build (compression manager)")
ALGORITHM = "kvzap"

# Set by install() / install_sparse_kv(): "scorer", "mapping", "world" (tensor-parallel size), "evicts" (entries
# leave the cache physically, so RoPE must come from position_ids), "config_class" (built once). A process-wide
# singleton, forced by TensorRT-LLM's contract: TensorRT-LLM builds the compression manager and the attention modules
# itself (from an algorithm name, through the factories ``install`` patches), so what ``install`` set up can only be
# reached from here.
STATE: dict = {}


def engine_module(module: str):
    """A module of TensorRT-LLM, or MissingDependencyError in one line naming what to install."""
    return import_engine(module, "KVzap's TensorRT-LLM integration", INSTALL)


def scorer():
    """The process's ``scoring.KVzapScorer`` (created by ``install`` / ``install_sparse_kv``); not imported here:
    ``scoring`` imports this module."""
    if "scorer" not in STATE:
        raise ConfigError("KVzap's TensorRT-LLM glue is not installed in this process; call install(bundle)")
    return STATE["scorer"]


def tp_size_rank() -> tuple[int, int]:
    mapping = STATE.get("mapping")
    return (mapping.tp_size, mapping.tp_rank) if mapping is not None else (1, 0)


def check_mapping(mapping) -> None:
    """Every layer must be scored in this process, and every rank must schedule the same requests."""
    if mapping is None:
        return
    if getattr(mapping, "pp_size", 1) > 1:
        raise ConfigError(f"pipeline parallelism (pp_size={mapping.pp_size}) is not supported by KVzap's TensorRT-LLM "
                          "glue: each step's decision needs every layer's scores in one process")
    if getattr(mapping, "enable_attention_dp", False):
        raise ConfigError("attention data parallelism is not supported by KVzap's TensorRT-LLM glue: ranks must "
                          "schedule the same requests to agree on one count per request")

