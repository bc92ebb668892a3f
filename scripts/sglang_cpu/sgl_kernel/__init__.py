"""Plain-torch stand-ins for the sgl-kernel CPU ops that SGLang 0.5.23 imports on a CPU-only machine.

A test-environment aid, not part of kvzap-export: ``scripts/sglang_cpu_env.sh`` puts this directory on the
engine environment's path (a .pth file) because sgl-kernel has no CPU build on the package registry and,
with ``SGLANG_USE_CPU_ENGINE=1``, two modules on the dense-attention path import from it unconditionally:

- ``sglang/srt/mem_cache/allocation.py`` imports ``assign_req_to_token_pool_cpu`` and calls it for every
  batch (it writes the new tokens' slot ids into the requests' ``req_to_token`` rows): implemented here.
- ``sglang/kernels/ops/kvcache/cache_move.py`` imports ``copy_all_layer_kv_cache_cpu`` (a copy between raw
  data pointers, used when the allocator defragments or hierarchical caching moves pages), and the
  speculative-decoding modules (``sglang/kernels/ops/speculative/{eagle,multi_layer_eagle,cache_locs,spec_tree}.py``),
  which the scheduler imports whatever the server's settings, import six more CPU ops. Nothing on the paths
  we run calls them: they are importable and raise when called (``_IMPORTED_NOT_PROVIDED``), so a run that
  would need one stops loudly instead of computing garbage.

Any other attribute raises ``NotProvided`` (an ``AttributeError`` and a ``NotImplementedError``) naming it (speculative-decoding and mamba modules
import more ops; they are not supported in this environment). ``torch.ops.sgl_kernel`` is left empty, so
SGLang's AMX check (``cpu_has_amx_support``) is false and it uses its plain-torch RMSNorm, SiLU and rotary.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+kvzap-cpu-standin"

_WHY = "is not provided by kvzap-export's CPU stand-in for sgl-kernel (scripts/sglang_cpu/sgl_kernel)"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, start_offset: torch.Tensor,
                                 end_offset: torch.Tensor, out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """For each request ``i``: ``req_to_token[req_pool_indices[i], start[i]:end[i]]`` = its slice of ``out_cache_loc``.

    req_pool_indices, start_offset, end_offset: int [batch]; req_to_token: int32 [max_requests, pool_len];
    out_cache_loc: int [sum(end - start)], the requests' new slots back to back in batch order.
    """
    starts, ends = start_offset.tolist(), end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n <= 0:
            continue
        if end > pool_len:
            raise IndexError(f"assign_req_to_token_pool_cpu: end offset {end} beyond the row length {pool_len}")
        req_to_token[row, start:end] = out_cache_loc[offset: offset + n].to(req_to_token.dtype)
        offset += n


def _not_provided(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} {_WHY}; the KVzap CPU engine runs do not use the paths that call it "
                                  "(speculative decoding, KV defragmentation, hierarchical caching)")

    op.__name__ = op.__qualname__ = name
    return op


# Imported at module level by SGLang on the CPU (so they must exist), never called on our paths.
_IMPORTED_NOT_PROVIDED = (
    "copy_all_layer_kv_cache_cpu",  # kernels/ops/kvcache/cache_move.py
    "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu",  # kernels/ops/speculative/eagle.py
    "rotate_input_ids_cpu",  # kernels/ops/speculative/multi_layer_eagle.py
    "assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",  # kernels/ops/speculative/cache_locs.py
    "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu",  # kernels/ops/speculative/spec_tree.py
)
globals().update({name: _not_provided(name) for name in _IMPORTED_NOT_PROVIDED})


class NotProvided(AttributeError, NotImplementedError):
    """An op this stand-in does not provide. An AttributeError too, so that ``hasattr`` and
    ``try: from sgl_kernel import op / except ImportError`` behave as with a build that lacks the op."""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise NotProvided(f"sgl_kernel.{name} {_WHY}")
