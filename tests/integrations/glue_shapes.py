"""Shapes of the glue tests' small model, a stand-in of an engine's forward mode and one of TensorRT-LLM's attention
metadata."""

from types import SimpleNamespace

import torch

LAYERS, KV_HEADS, HIDDEN, DIM = 3, 2, 16, 4
WINDOW = 6


def mode(extend: bool):
    return SimpleNamespace(is_extend=lambda: extend, is_decode=lambda: not extend)


def attention_metadata(requests: list[tuple[int, int]], num_contexts: int):
    """The fields of TensorRT-LLM's ``AttentionMetadata`` KVzap reads: per sequence its request id and query
    tokens (``seq_lens``, a CPU tensor), context sequences first."""
    return SimpleNamespace(request_ids=[rid for rid, _ in requests], seq_lens=torch.tensor([n for _, n in requests]),
                           num_contexts=num_contexts, is_cuda_graph=False)
