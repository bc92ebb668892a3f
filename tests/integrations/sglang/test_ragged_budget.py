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
from kvzap_export.integrations.sglang.ragged_parts import RaggedParts

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
    # the row tables' buffer, TABLE_COLUMNS int32 columns per entry, allocated with the pool (and its scratch cell)
    store.reserve_table(want["row_tables"] // 4, slots=3)
    assert store.nbytes()["row_tables"] <= want["row_tables"] + 4  # with the slots' starts and lengths (+ scratch)
    assert store.nbytes()["row_tables"] > want["row_tables"] - 4 - 4 * LAYERS * HEADS


def _configurator(requests: int = 6):
    model = SimpleNamespace(head_dim=DIM, v_head_dim=DIM, num_hidden_layers=LAYERS, num_attention_heads=2 * HEADS,
                            get_num_kv_heads=lambda tp: HEADS)
    return SimpleNamespace(model_config=model, device="cpu", kv_cache_dtype=torch.float32,
                           resolve_max_num_reqs=lambda tokens: min(requests, tokens // 2))


def test_the_hook_hands_sglang_the_budget_less_the_bookkeeping(monkeypatch):
    monkeypatch.delenv("KVZAP_RAGGED_DECODE_KERNEL", raising=False)
    parts = RaggedParts()  # this process's pieces: the hook sets the plan there
    monkeypatch.setattr(ragged_radix, "shares_prefixes", lambda: False)  # SGLang's radix cache off
    monkeypatch.setattr(ragged_budget, "graph_batch", lambda requests: 4)  # SGLang's decode graphs up to batch 4
    configurator = _configurator()
    seen = []

    def original(conf, budget_bytes, *, cap_tokens=None):
        seen.append((conf, budget_bytes, cap_tokens))
        return SimpleNamespace(max_total_num_tokens=budget_bytes // (LAYERS * HEADS * 2 * DIM * 4))

    budget_hook(parts, original, configurator, 1_000_000)
    p = parts.plan
    assert p.budget == 1_000_000 and "decode_indices" not in p.extras and not p.fixed  # the CPU's torch decode path
    assert seen == [(configurator, p.dense_budget(), None)] and p.dense_budget() < 1_000_000
    monkeypatch.setenv("KVZAP_RAGGED_DECODE_KERNEL", "sglang")  # the flattened path: kv_indices and the step buffers
    budget_hook(parts, original, configurator, 1_000_000)
    flat = parts.plan
    assert flat.extras["decode_indices"] == 8 and flat.fixed["decode_buffers"] > 0
    assert seen[-1][1] == flat.dense_budget() < seen[-2][1] < p.dense_budget()  # sized again, the buffers set aside
    monkeypatch.setattr(ragged_radix, "shares_prefixes", lambda: True)  # radix on: reference counts and slot records
    budget_hook(parts, original, configurator, 1_000_000)
    shared = parts.plan
    assert shared.extras["sharing"] == 5 and shared.extras["slot_records"] == ragged_budget.slot_record_bytes(LAYERS)
    assert seen[-1][1] < seen[-3][1]


@pytest.mark.parametrize("requests, graph", [(6, 4), (3, 8), (40, 0)])
def test_the_decode_buffers_set_aside_are_what_the_backend_allocates(requests, graph):
    """The bytes the plan sets aside for the flattened decode path's step buffers equal what ``DecodeBuffers`` built
    as the backend builds them (``ragged._buffers``: request rows, the largest graph batch, the GPU's splits)
    allocates, less the per-entry ``kv_indices`` the plan counts per entry."""
    from kvzap_export.integrations.sglang.ragged_decode import DecodeBuffers
    from kvzap_export.kernels.flattened_step import GPU_SMALL_BATCH_SPLITS, GPU_SPLITS

    model = _configurator().model_config
    set_aside = ragged_budget.decode_buffer_bytes(model, torch.bfloat16, requests, graph)
    store = RaggedStore(500, LAYERS, HEADS, DIM, rows=1, width=1, dtype=torch.bfloat16)
    built = DecodeBuffers(store, max(graph, requests), 2, torch.bfloat16, kernels=object(), use_triton=False,
                          max_kv_splits=GPU_SPLITS, logits_batch=max(graph, 1), small_batch_splits=GPU_SMALL_BATCH_SPLITS)
    indices = built.flat.kv_indices
    assert set_aside == built.nbytes() - indices.numel() * indices.element_size()


@pytest.mark.parametrize("pruned", [0.4, 0.7])
def test_one_long_request_beside_many_short_ones_stays_inside_the_budget(caplog, pruned):
    """A pool sized from a budget as the engine sizes it (K, V, scores, free list, the row tables' reservation): one
    long request, its prompt decided at ``pruned`` (τ the quantile of its scores), then as many short requests as the
    freed room admits, decided too, then decode steps with decisions. What the store allocated never exceeds the
    budget and its row tables never grow past their reservation. (Row tables as wide as the longest row, for every
    request held, would take 3.3 MB here beside 50 short ones, against 0.22 MB reserved.)"""
    budget = 4_000_000
    p = plan(budget, DIM, DIM, torch.float32, False)
    entries = dense_tokens(p.dense_budget(), p.kv_bytes) * LAYERS * HEADS
    store = RaggedStore(entries, LAYERS, HEADS, DIM, rows=4, width=16)
    store.reserve_table(p.split(entries)["row_tables"] // 4, slots=256)  # up to 256 requests at once
    per_token, window = LAYERS * HEADS, 16
    g = torch.Generator().manual_seed(int(pruned * 10))

    def admit(row: int, tokens: int) -> None:
        new = store.append([row], [tokens])
        store.scores[new.reshape(-1)] = torch.randn(new.numel(), generator=g)
        tau = float(torch.nanquantile(store.prompt_scores([row], window), pruned))
        store.decide_prefill([row], tau, window)

    def inside() -> None:
        allocated = sum(store.nbytes().values())
        assert allocated <= budget, (allocated, budget)

    admit(0, int(0.6 * entries / per_token))  # the long one: 60% of the pool's tokens
    inside()
    rows = [0]
    while store.available >= 40 * per_token:  # short prompts into the room the decisions freed
        rows.append(len(rows))
        admit(rows[-1], 32)
        inside()
    assert len(rows) > 50  # far more requests than a dense pool holds beside the long one
    for _ in range(8):
        if store.available < len(rows) * per_token:
            break
        store.append(rows, [1] * len(rows))
        store.decide_decode(rows, 0.0, window)
        inside()
    with caplog.at_level(logging.WARNING, logger="kvzap_export"):
        assert store.table.grown == 0 and not [r for r in caplog.records if "row tables" in r.getMessage()]


def test_sglangs_post_capture_resize_is_refused_in_one_line(monkeypatch):
    from kvzap_export.errors import ConfigError

    parts = RaggedParts()
    configurator = SimpleNamespace(model_config=SimpleNamespace(head_dim=DIM, v_head_dim=DIM), device="cpu",
                                   kv_cache_dtype=torch.float32)
    with pytest.raises(ConfigError, match="SGLANG_ENABLE_POST_CAPTURE_KV_SIZING"):
        budget_hook(parts, lambda *a, **k: "config", configurator, 1_000_000, cap_tokens=500)
    assert parts.plan is None


def test_records_stay_inside_the_budget_when_the_slot_ids_run_far_past_the_dense_tokens(caplog):
    """Radix cache on, 72% of each prompt pruned: a pool sized from a budget as the engine sizes it (reference counts, record marks,
    records), prompts recorded under fresh engine slot ids (SGLang's logical allocator grows with the requests KVzap's
    freeing admits), decided, and their records ended when the pool runs short (the reclaim's last resort). The slot
    ids reach more than three times the pool's dense tokens; what the store allocated never exceeds the budget, and
    the records' index stays inside its reservation. (Records indexed by slot id, 25 bytes a slot here, took 84 bytes
    per dense token at 3.4 slot ids per token against 60 reserved.)"""
    from kvzap_export.integrations.ragged_shared import SharedRaggedStore

    budget, per_token, window, prompt = 4_000_000, LAYERS * HEADS, 16, 160
    p = plan(budget, DIM, DIM, torch.float32, False, shared=True, per_token=LAYERS)
    tokens = dense_tokens(p.dense_budget(), p.kv_bytes)
    store = SharedRaggedStore(tokens * per_token, LAYERS, HEADS, DIM, rows=4, width=16, slots=tokens + 1)
    store.reserve_table(p.split(store.capacity)["row_tables"] // 4, slots=256)
    store.records.reserve = ragged_budget.SLOT_INDEX * tokens  # as the allocator hook sets it
    g = torch.Generator().manual_seed(7)
    next_slot, recorded = 1, []
    with caplog.at_level(logging.WARNING, logger="kvzap_export"):
        for row in range(256):
            if store.available < (prompt + window) * per_token:
                if not recorded:
                    break
                store.drop_records(torch.cat(recorded))  # soft entries back to the free list
                store.exact()
                recorded = []
                if store.available < (prompt + window) * per_token:
                    break
            new = store.append([row], [prompt])
            store.scores[new.reshape(-1)] = torch.randn(new.numel(), generator=g)
            slots = torch.arange(next_slot, next_slot + prompt)
            next_slot += prompt
            assert store.record([row], [prompt], slots, new, slots_below=next_slot) == prompt
            recorded.append(slots)
            tau = float(torch.nanquantile(store.prompt_scores([row], window), 0.8))  # 0.8 of the 144 outside the window
            store.decide_prefill([row], tau, window)
            allocated = sum(store.nbytes().values())
            assert allocated <= budget, (allocated, budget, next_slot / tokens)
    assert next_slot > 3 * tokens  # the slot ids ran past three times the dense tokens
    assert store.records.entries.shape[0] == tokens + 1  # one record row per dense token (and the sink)
    assert not [r for r in caplog.records if "reservation" in r.getMessage()]
