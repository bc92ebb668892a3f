"""``sgl_kernel.kvcacheio`` of kvzap-export's CUDA stand-in (see the package docstring). SGLang 0.5.23 imports these
host<->device KV transfer ops when its host-memory pools load on CUDA (``srt/mem_cache/memory_pool_host.py:45``,
``srt/mem_cache/pool_host/{mha,mla,mamba}.py``); only hierarchical caching calls them, which the stand-in does not
cover: each raises ``NotImplementedError`` naming itself."""

from __future__ import annotations

from sgl_kernel import NotProvided, _not_provided

_IMPORTED_NOT_PROVIDED = (
    "transfer_kv_all_layer", "transfer_kv_all_layer_direct_lf_pf", "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph", "transfer_kv_all_layer_mla", "transfer_kv_all_layer_mla_lf_pf", "transfer_kv_direct",
    "transfer_kv_per_layer", "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf", "transfer_kv_per_layer_pf_lf", "transfer_kv_per_layer_ph_lf",
)
globals().update({name: _not_provided(f"kvcacheio.{name}") for name in _IMPORTED_NOT_PROVIDED})


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise NotProvided(f"sgl_kernel.kvcacheio.{name} is not provided by kvzap-export's CUDA stand-in for sgl-kernel")
