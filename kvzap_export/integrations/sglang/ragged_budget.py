"""Ragged mode inside SGLang's KV budget: the store's bookkeeping counted in the bytes SGLang sizes its pool with.

SGLang turns its memory profile (``--mem-fraction-static``) into a KV byte budget and divides it by a dense token's
K/V bytes (``KVCacheConfigurator.config_from_budget``). In ragged mode each of those tokens is ``layers · kv_heads``
one-head entries of the ``RaggedStore``, and every entry costs more than its K and V:

- its score (the store's dtype), kept until a decision tests it;
- its slot in the free list (int32);
- ``TABLE_COLUMNS`` columns of the row tables (int32 entry ids), allocated with the pool. Each (request, layer, KV
  head) row has its own capacity (``integrations/row_table.py``): at most a quarter more than it holds once rows are
  packed, plus ``MIN_COLUMNS`` of rounding, so a full pool's rows need about 1.25 columns per entry whatever the
  pruning or the mix of long and short requests; two columns cover that with room for the rounding of up to
  ``0.75 · entries / MIN_COLUMNS`` rows. Past that the table grows and logs it;
- on the flattened decode path (SGLang's decode kernel, ``KVZAP_RAGGED_DECODE_KERNEL=sglang``, the default on CUDA)
  its place in the step's ``kv_indices`` (int64);
- with SGLang's radix cache on (``ragged_radix.py``): its reference count (int32) and record mark (bool), and the
  slots' records (``integrations/slot_records.py``, ``slot_record_bytes``): a record's entry ids, one int32 per entry
  (at most one record per dense token is alive, whatever the slot ids), and, spread over a dense token's entries, the
  records' free stack and their index by logical slot id (int32), reserved for ``SLOT_INDEX`` logical slots per dense
  token (the logical slot ids grow with the requests KVzap's freeing admits: 2.1x the dense tokens at 53% pruned;
  past the reservation the index grows and logs it).

The AROUND hook on ``config_from_budget`` hands SGLang's sizing the part of the budget that leaves room for these:
``budget · kv / (kv + extras)`` per entry (one entry kept back for the store's scratch row), so the pool SGLang
derives plus the bookkeeping fits what ``--mem-fraction-static`` gives. A ``--max-total-tokens`` cap still applies after (a smaller pool, the
same per-entry costs: still inside); SGLang's post-capture resize (``cap_tokens``) is refused. Packing the row
tables' rows holds the old and the new buffer for the copy (a table-sized transient).

On the flattened decode path (CUDA) the step buffers (``ragged_decode.DecodeBuffers``: each layer's rows, the
kernel's partial results for the largest decode graph batch; 139 MB for Llama-3.1-8B in bf16 at 256 rows and graph
batch 256, computed) do not scale with the entries: the hook sizes the pool once, asks SGLang how many request rows that pool gets (``resolve_max_num_reqs``),
sets the buffers for those rows and its decode graphs aside (``BudgetPlan.fixed``) and sizes the pool again; the
backend logs a warning if what it builds exceeds that.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from kvzap_export.errors import ConfigError
from kvzap_export.integrations.sglang.api import sglang_module

TABLE_COLUMNS = 2  # row-table columns reserved per entry (module docstring)
SLOT_INDEX = 8  # logical slot ids per dense token the records' index is reserved for, radix cache on (module docstring)


def slot_record_bytes(per_token: int) -> int:
    """Per entry, radix cache on: the records' entry ids (int32; one record per dense token), and a dense token's
    share of the records' free stack (int32 per record), index (int32 for each of ``SLOT_INDEX`` logical slots) and one
    int32 more (the sink rows and the stack's top, once per pool), spread over ``per_token`` entries, rounded up.
    ``per_token``: the fewest entries a dense token has on a rank, the layers alone (a rank holding one KV head), so
    that the share is never short under tensor parallelism."""
    return 4 + -(-4 * (2 + SLOT_INDEX) // max(per_token, 1))


@dataclass(frozen=True)
class BudgetPlan:
    """Per-entry bytes of the ragged pool and the budget SGLang gave it (``budget`` bytes)."""

    budget: int
    kv_bytes: int  # K + V of one entry
    extras: dict[str, int] = field(default_factory=dict)  # per entry, by part
    fixed: dict[str, int] = field(default_factory=dict)  # bytes that do not scale with the entries (decode buffers)

    @property
    def entry_bytes(self) -> int:
        return self.kv_bytes + sum(self.extras.values())

    def dense_budget(self) -> int:
        """The bytes SGLang's sizing is given: what dense K/V of the same entry count would take (one entry's bytes
        kept back for the store's scratch row and spare free-list slot)."""
        return max(self.budget - sum(self.fixed.values()) - self.entry_bytes, 0) * self.kv_bytes // self.entry_bytes

    def split(self, entries: int) -> dict[str, int]:
        """Bytes of each part for a pool of ``entries`` entries (the tables at their reservation)."""
        return {"kv": entries * self.kv_bytes, **{name: entries * size for name, size in self.extras.items()}}

    def against(self, allocated: dict[str, int], entries: int) -> dict[str, int]:
        """The budget beside what a store of ``entries`` entries allocated (``RaggedStore.nbytes()``: K, V, scores,
        free list; scratch row included) and the parts that grow later at their reservation (row tables, decode
        indices)."""
        reserved = self.split(entries)
        return {"budget": self.budget, "kv": allocated["k"] + allocated["v"], "scores": allocated["scores"],
                "free_list": allocated["free_list"],
                **({"sharing": allocated["sharing"]} if "sharing" in allocated else {}),
                **{f"{name}_reserved": size for name, size in reserved.items()
                   if name in ("row_tables", "decode_indices", "slot_records")},
                **{f"{name}_reserved": size for name, size in self.fixed.items()}}

    def describe(self, entries: int) -> str:
        parts = {**self.split(entries), **self.fixed}
        gb = lambda n: f"{n / 2**30:.3f}"  # noqa: E731
        rest = ", ".join(f"{name.replace('_', ' ')} {gb(size)}" for name, size in parts.items() if name != "kv")
        return (f"{gb(sum(parts.values()))} of SGLang's {gb(self.budget)} GB KV budget: K/V {gb(parts['kv'])}, {rest} "
                f"({self.entry_bytes} bytes per entry, {self.kv_bytes} of them K/V)")


def plan(budget_bytes: int, head_dim: int, v_head_dim: int, dtype: torch.dtype, flattened_decode: bool,
         shared: bool = False, per_token: int = 1) -> BudgetPlan:
    """The per-entry costs (module docstring); ``per_token``: ``slot_record_bytes``' (the layers)."""
    size = torch.empty(0, dtype=dtype).element_size()
    extras = {"scores": size, "free_list": 4, "row_tables": 4 * TABLE_COLUMNS}
    if flattened_decode:
        extras["decode_indices"] = 8
    if shared:
        extras.update(sharing=4 + 1, slot_records=slot_record_bytes(per_token))
    return BudgetPlan(int(budget_bytes), (head_dim + v_head_dim) * size, extras)


def budget_hook(parts, original_fn, configurator, budget_bytes, *args, **kwargs):
    """AROUND ``KVCacheConfigurator.config_from_budget`` (bound to this process's ``RaggedParts`` by
    ``ragged.register``): SGLang sizes the pool with the budget less the entries' bookkeeping (module docstring); the
    plan is ``parts.plan``."""
    from kvzap_export.integrations.sglang.ragged_decode import decode_kernel
    from kvzap_export.integrations.sglang.ragged_radix import shares_prefixes

    if kwargs.get("cap_tokens") is not None:  # SGLang's post-capture resize of an existing pool (not the launch's)
        raise ConfigError("KVzap ragged mode does not support SGLang's post-capture KV sizing (it resizes a pool the "
                          "ragged store replaces); unset SGLANG_ENABLE_POST_CAPTURE_KV_SIZING")
    model = configurator.model_config
    device = torch.device(configurator.device)
    flattened = decode_kernel(device) == "sglang"
    per_token = int(model.num_hidden_layers)  # a token's entries on a rank holding one KV head: never under-reserved
    parts.plan = plan(budget_bytes, int(model.head_dim), int(model.v_head_dim), configurator.kv_cache_dtype,
                      flattened, shares_prefixes(), per_token)
    config = original_fn(configurator, parts.plan.dense_budget(), *args, **kwargs)
    if not flattened:
        return config
    # The flattened decode path's step buffers, sized by the request rows and the largest decode graph (the backend's
    # ``_buffers``): set aside, then the pool sized again (SGLang derives its request rows from the pool's tokens, so
    # the smaller pool can only have as many).
    requests = int(configurator.resolve_max_num_reqs(int(config.max_total_num_tokens)))  # at most this many after
    fixed = decode_buffer_bytes(model, configurator.kv_cache_dtype, requests, graph_batch(requests))
    if fixed:
        parts.plan = dataclasses.replace(parts.plan, fixed={"decode_buffers": fixed})
        config = original_fn(configurator, parts.plan.dense_budget(), *args, **kwargs)
    return config


def graph_batch(requests: int) -> int:
    """The largest decode batch SGLang captures a graph for (its resolved setting; the request rows if unset), 0
    without decode graphs."""
    context = sglang_module("sglang.srt.runtime_context")
    try:
        decode = context.get_exec().graph.cuda_graph_config.decode
    except (AttributeError, ValueError):
        return requests
    if decode.backend == "disabled":
        return 0
    return int(decode.max_bs or requests)


def decode_buffer_bytes(model, dtype: torch.dtype, requests: int, graph: int) -> int:
    """``DecodeBuffers``' bytes besides its per-entry indices for ``requests`` request rows and decode graphs up to
    ``graph`` requests, as the backend builds them (``ragged.py``'s ``_buffers``: GPU splits)."""
    from kvzap_export.integrations.sglang.ragged_decode import buffer_bytes
    from kvzap_export.kernels.flattened_step import GPU_SMALL_BATCH_SPLITS, GPU_SPLITS

    if requests <= 0:
        return 0
    heads = int(model.get_num_kv_heads(1))
    return buffer_bytes(int(model.num_hidden_layers), heads, int(model.num_attention_heads) // heads,
                        int(model.head_dim), int(model.v_head_dim), dtype, max(graph, requests), max(graph, 1),
                        GPU_SPLITS, GPU_SMALL_BATCH_SPLITS)
