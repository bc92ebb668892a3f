"""Ragged mode inside SGLang's KV budget (``integrations/sglang/ragged_budget.py``): the bytes handed to SGLang's sizing
leave room for the store's bookkeeping, and the per-entry figures are what ``RaggedStore`` allocates.

SGLang itself is not imported here; its sizing is modelled by ``dense_tokens`` (budget // a dense token's K/V bytes,
its ``calculate_pool_sizes`` for a plain MHA/GQA model). The real engine's budget path is checked by the ragged engine
test (``test_engine.py``: the pool and its bookkeeping inside the budget SGLang profiled).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from kvzap_export.integrations.ragged_store import RaggedStore
from kvzap_export.integrations.sglang import ragged_budget, ragged_radix
from kvzap_export.integrations.sglang.ragged_budget import budget_hook, plan

LAYERS, HEADS, DIM = 3, 2, 16


def dense_tokens(budget: int, kv_bytes: int) -> int:
    return budget // (LAYERS * HEADS * kv_bytes)


@pytest.mark.parametrize("dtype,flattened", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_the_pool_sized_from_the_handed_budget_and_its_bookkeeping_fit_the_budget(dtype, flattened):
    """SGLang's sizing (modelled) on the handed budget, then a real store of that size: what the store allocates (K,
    V, scores, free list, its scratch row and spare slot) plus the reserved parts fits the budget, tightly."""
    budget = 10_000_000
    p = plan(budget, DIM, DIM, dtype, flattened)
    size = torch.empty(0, dtype=dtype).element_size()
    assert p.kv_bytes == 2 * DIM * size
    tables = 4 * ragged_budget.TABLE_COLUMNS
    assert p.extras == {"scores": size, "free_list": 4, "row_tables": tables, **({"decode_indices": 8} if flattened else {})}
    entries = dense_tokens(p.dense_budget(), p.kv_bytes) * LAYERS * HEADS
    store = RaggedStore(entries, LAYERS, HEADS, DIM, rows=1, width=1, dtype=dtype)
    report = p.against(store.nbytes(), entries)
    used = sum(v for part, v in report.items() if part != "budget")
    assert report["budget"] == budget and used <= budget
    assert budget - used < (LAYERS * HEADS + 1) * p.entry_bytes  # tight: less than one more token (and the scratch)
    assert entries < dense_tokens(budget, p.kv_bytes) * LAYERS * HEADS  # SGLang alone would have sized more


def test_the_plans_per_entry_bytes_are_what_the_store_and_the_decode_buffers_allocate():
    from kvzap_export.kernels.flattened_step import FlattenedStep

    p = plan(1 << 20, DIM, DIM, torch.bfloat16, True)
    entries = 600
    store = RaggedStore(entries, LAYERS, HEADS, DIM, rows=1, width=1, dtype=torch.bfloat16)
    got, want = store.nbytes(), p.split(entries)
    assert got["k"] + got["v"] == want["kv"] + p.kv_bytes  # the store's scratch row past the entries
    assert got["scores"] == want["scores"] + p.extras["scores"]
    assert got["free_list"] == want["free_list"] + p.extras["free_list"]  # the spare slot
    # the decode step's kv_indices (the flattened CUDA path), one past the entries
    step = FlattenedStep(LAYERS, 1, HEADS, 1, DIM, entries, dtype=torch.bfloat16, device="cpu", kernels=object(),
                         use_triton=False)
    assert step.kv_indices.numel() * step.kv_indices.element_size() == want["decode_indices"] + 8
    # tables as wide as TABLE_COLUMNS columns for each token's (layer, head) entries take the reserved bytes
    wide = RaggedStore(entries, LAYERS, HEADS, DIM, rows=entries // (LAYERS * HEADS),
                       width=ragged_budget.TABLE_COLUMNS, dtype=torch.bfloat16)
    assert wide.ids.numel() * wide.ids.element_size() == want["row_tables"]


def test_the_hook_hands_sglang_the_budget_less_the_bookkeeping(monkeypatch):
    monkeypatch.delenv("KVZAP_RAGGED_DECODE", raising=False)
    monkeypatch.setattr(ragged_budget, "_PLAN", None)  # this process's plan: set by the hook, restored after
    monkeypatch.setattr(ragged_radix, "shares_prefixes", lambda: False)  # SGLang's radix cache off
    configurator = SimpleNamespace(model_config=SimpleNamespace(head_dim=DIM, v_head_dim=DIM), device="cpu",
                                   kv_cache_dtype=torch.float32)
    seen = []

    def original(conf, budget_bytes, *, cap_tokens=None):
        seen.append((conf, budget_bytes, cap_tokens))
        return "config"

    assert budget_hook(original, configurator, 1_000_000) == "config"
    p = ragged_budget.current_plan()
    assert p.budget == 1_000_000 and "decode_indices" not in p.extras  # the CPU's torch decode path
    assert seen == [(configurator, p.dense_budget(), None)] and p.dense_budget() < 1_000_000
    monkeypatch.setenv("KVZAP_RAGGED_DECODE", "flattened")  # the flattened path's kv_indices, 8 bytes per entry
    budget_hook(original, configurator, 1_000_000)
    assert ragged_budget.current_plan().extras["decode_indices"] == 8 and seen[-1][1] < p.dense_budget()
    monkeypatch.setattr(ragged_radix, "shares_prefixes", lambda: True)  # radix on: reference counts and slot records
    budget_hook(original, configurator, 1_000_000)
    shared = ragged_budget.current_plan()
    assert shared.extras["sharing"] == 5 and shared.extras["slot_records"] == ragged_budget.SLOT_RECORD_BYTES
    assert seen[-1][1] < seen[-2][1]


def test_the_store_warns_once_when_its_tables_outgrow_their_reservation(caplog):
    store = RaggedStore(1000, LAYERS, HEADS, DIM, rows=2, width=4)
    store.table_budget = store.ids.numel() * store.ids.element_size()
    with caplog.at_level(logging.WARNING, logger="kvzap_export.integrations.ragged_store"):
        store.append([0], [4])  # fits the tables as they are
        assert not caplog.records
        store.append([1, 2], [8, 8])  # a third row and wider: the tables grow
        store.append([3, 4], [40, 40])  # and again
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "outgrew" in warned[0], warned


def test_sglangs_post_capture_resize_is_refused_in_one_line(monkeypatch):
    from kvzap_export.errors import ConfigError

    monkeypatch.setattr(ragged_budget, "_PLAN", None)
    configurator = SimpleNamespace(model_config=SimpleNamespace(head_dim=DIM, v_head_dim=DIM), device="cpu",
                                   kv_cache_dtype=torch.float32)
    with pytest.raises(ConfigError, match="SGLANG_ENABLE_POST_CAPTURE_KV_SIZING"):
        budget_hook(lambda *a, **k: "config", configurator, 1_000_000, cap_tokens=500)
    assert ragged_budget.current_plan() is None
