"""Ragged decode in buffers allocated once (``integrations/sglang/ragged_decode.py``): what a CUDA graph of the decode
forward reads keeps its data pointer, and a step's host<->device transfers stay 0 inside the forward.

The steps here run the sequence the ragged backend runs around SGLang's forward (``ragged.py``): the aux cache's
layout (``StoreRows.alloc_to_lengths`` / ``take_plan``), the backend's ``DecodeBuffers.layout`` before the forward,
per layer the K/V write (``write_entries``), the scoring hook's score write and the attention, then the step end's
decisions. SGLang's decode kernel runs in Triton's CPU interpreter (on a GPU machine, compiled, on CUDA tensors: the
interpreter is off there); each layer's output is compared with
``ragged_attention.ragged_decode_attention``, the float32 formula, over the entries read back from the store's tables.
The engine itself runs the same path in test_engine.py (``KVZAP_RAGGED_DECODE_KERNEL=sglang``). Without SGLang's kernel
file the tests skip, saying so.
"""

from __future__ import annotations

import pytest
import torch

from kvzap_export.integrations.host_reads import Transfers
from kvzap_export.integrations.ragged_shared import SharedRaggedStore
from kvzap_export.integrations.ragged_store import RaggedStore
from kvzap_export.integrations.sglang.ragged_rows import StoreRows
from kvzap_export.integrations.sglang.ragged_decode import DecodeBuffers, write_entries
from kvzap_export.kernels.ragged_attention import ragged_decode_attention

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
HEADS, GROUP, DIM, WINDOW = 2, 2, 16, 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled Triton needs CUDA tensors (scripts/gpu_check.sh)
# on a GPU, SGLang's grouped kernel multiplies float32 through tl.dot in TF32 (Triton's default)
F32 = dict(atol=1e-5, rtol=1e-5) if DEVICE == "cpu" else dict(atol=5e-3, rtol=5e-3)


@pytest.fixture(scope="module")
def kernels(sglang_kernels):
    return sglang_kernels


class Run:
    """A store of ``requests`` prompts already decided, with decode buffers for one more (padding) row."""

    def __init__(self, kernels, requests: int, layers: int, seed: int = 0, device: str = DEVICE,
                 dtype: torch.dtype = torch.float32):
        self.g = torch.Generator().manual_seed(seed)
        self.layers, self.device, self.dtype = layers, device, dtype
        # small row tables (2 slots, 8 columns): growth happens during the steps
        self.store = RaggedStore(40000, layers, HEADS, DIM, rows=2, width=8, dtype=dtype, device=device)
        self.aux = StoreRows(self.store, 10**6)
        # two splits per row, four at small batches (the engine: 32 / 64 on a GPU): SGLang's kernel runs interpreted
        # on the CPU (32 splits take minutes)
        self.buffers = DecodeBuffers(self.store, requests + 1, GROUP, dtype, kernels=kernels, max_kv_splits=2,
                                     small_batch_splits=4)
        self.rows = list(range(1, requests + 1))
        self.lengths = [9 + 5 * r for r in self.rows]
        _, _, ids = self.plan()
        self.write(ids)
        self.store.decide_prefill(self.rows, 0.0, WINDOW)

    def plan(self):
        self.aux.alloc_to_lengths(req_pool_indices_cpu=torch.tensor(self.rows),
                                  target_seq_lens_cpu=torch.tensor(self.lengths))
        return self.aux.take_plan(self.lengths + [1], padded=True)  # SGLang's padding row: length 1

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.g).to(self.device, self.dtype)

    def write(self, ids, layers=None):
        """Random K/V and scores (the scoring hook's write) at the new entries ids [L, H, T]."""
        for layer in range(self.layers) if layers is None else layers:
            T = ids.shape[-1]
            write_entries(self.store, ids[layer], self.randn(T, HEADS, DIM), self.randn(T, HEADS, DIM))
            self.store.scores.index_copy_(0, ids[layer].T.reshape(-1), self.randn(T * HEADS))

    def step(self, check: bool = True) -> dict:
        """One decode step; returns the transfers of each phase (and checks every layer against the formula)."""
        self.lengths = [n + 1 for n in self.lengths]
        batch = len(self.rows) + 1
        queries = [self.randn(batch, HEADS * GROUP, DIM) for _ in range(self.layers)]
        outputs = [torch.empty(batch, HEADS * GROUP, DIM, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        with Transfers() as prepare:
            rows, _, new_ids = self.plan()
            decode = self.buffers.layout(rows, new_ids, batch)
        with Transfers() as forward:
            for layer in range(self.layers):
                self.write(decode.new_ids, [layer])
                self.buffers.attend(layer, queries[layer], 0.3, outputs[layer])
        if check:
            slots = self.store.slots(self.rows)
            for layer in range(self.layers):
                width = self.store.widths(self.rows)[layer]
                want = ragged_decode_attention(queries[layer][:-1], self.store.k, self.store.v,
                                               self.store.layer_ids(slots, layer, width), self.store.lengths[slots, layer],
                                               0.3)
                torch.testing.assert_close(outputs[layer][:-1], want, **F32)
                assert not outputs[layer][-1].any()  # the padding row
        with Transfers() as end:
            self.store.decide_decode(self.rows, 0.0, WINDOW)
        return {"prepare": (prepare.reads, prepare.moves), "forward": (forward.reads, forward.moves),
                "end": (end.reads, end.moves)}


def test_fifty_decode_steps_keep_every_buffer_in_place_through_table_growth(kernels):
    """50 steps, lengths growing and heads pruned (τ = 0 on random scores), the row tables growing under them: every
    buffer the forward reads keeps its data pointer, the store's K/V/scores too, and every layer equals the formula."""
    run = Run(kernels, requests=3, layers=2)
    store = run.store
    pointers = {name: t.data_ptr() for name, t in run.buffers.buffers().items()}
    pointers.update(k=store.k.data_ptr(), v=store.v.data_ptr(), scores=store.scores.data_ptr())
    moved = store.table.relocated + store.table.packs
    held = store.held
    for _ in range(50):
        run.step()
        now = {name: t.data_ptr() for name, t in run.buffers.buffers().items()}
        now.update(k=store.k.data_ptr(), v=store.v.data_ptr(), scores=store.scores.data_ptr())
        assert now == pointers
    assert store.table.relocated + store.table.packs > moved, "no row outgrew its capacity: the test proves nothing"
    logical = 50 * 3 * 2 * HEADS  # entries appended by the 50 steps
    assert 0 < held + logical - store.held < logical  # some entries were evicted, not all


def test_a_decode_step_transfers_nothing_inside_the_forward_and_a_constant_around_it(kernels):
    """Counted per phase over 4 steps, for 1 to 5 requests and 1 to 3 layers: the forward (K/V and score writes,
    attention) makes no transfer; the layout before it and the decisions after it make the same number whatever the
    batch and the layers (the aux cache's upload, the slots' upload, the host mirror's lengths)."""
    seen = {}
    for requests, layers in ((1, 1), (3, 2), (5, 3)):
        run = Run(kernels, requests, layers, seed=requests)
        counts = [run.step(check=False) for _ in range(4)]
        assert all(c == counts[0] for c in counts), counts
        seen[(requests, layers)] = counts[0]
    first = next(iter(seen.values()))
    assert all(c == first for c in seen.values()), seen
    assert first["forward"] == (0, 0), first
    # before: the aux cache reads SGLang's two host lists and the store's host mirror (width, widths): 4 reads of
    # host tensors (no transfer on a GPU), and the last step's snapshot (top, soft, the decided rows' lengths: one
    # read of the pinned copy, ragged_mirror.py); 2 uploads (the appended entries' layout, the slots). After: the
    # decisions' one upload (slots, which rows test) and no read: the decision runs on the device alone.
    assert first["prepare"] == (5, 2) and first["end"] == (0, 1), first


def captured(forward) -> "torch.cuda.CUDAGraph":
    """``forward`` run once on a side stream (the kernels compile outside the capture), then captured in a graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    return graph


@pytest.mark.gpu
def test_a_decode_forward_captured_in_a_cuda_graph_replays_fifty_steps_like_eager(kernels):
    """On a GPU (bf16): every layer's K/V write, score write and attention captured ONCE in a ``torch.cuda.CUDAGraph``
    at a batch padded past the requests, with SGLang's capture layout (all padding); then 50 steps, lengths growing,
    heads pruned (τ = 0) and the row tables growing: each step laid out in the buffers and the graph replayed. Each
    layer's output equals the same kernel run eagerly on the same buffers (bit for bit) and the float32 formula over the
    store's entries (bf16 tolerance); the padding rows give zeros."""
    run = Run(kernels, requests=3, layers=2, device="cuda", dtype=torch.bfloat16)
    store, buffers, L, batch = run.store, run.buffers, run.layers, 4
    q = run.randn(L, batch, HEADS * GROUP, DIM)
    k_new, v_new, s_new = run.randn(L, batch, HEADS, DIM), run.randn(L, batch, HEADS, DIM), run.randn(L, batch * HEADS)
    out = torch.zeros(L, batch, HEADS * GROUP, DIM, dtype=torch.bfloat16, device="cuda")
    decode = buffers.capture_layout(batch)

    def forward():
        for layer in range(L):
            write_entries(store, decode.new_ids[layer], k_new[layer], v_new[layer])
            store.scores.index_copy_(0, decode.new_ids[layer].T.reshape(-1), s_new[layer])
            buffers.attend(layer, q[layer], 0.3, out[layer])

    graph = captured(forward)
    moved = store.table.relocated + store.table.packs
    for _ in range(50):
        run.lengths = [n + 1 for n in run.lengths]
        rows, _, new_ids = run.plan()
        assert buffers.layout(rows, new_ids, batch).new_ids.data_ptr() == decode.new_ids.data_ptr()
        for t in (q, k_new, v_new, s_new):
            t.copy_(run.randn(*t.shape))
        graph.replay()
        slots = store.slots(run.rows)
        for layer in range(L):
            eager = torch.empty_like(out[layer])
            buffers.attend(layer, q[layer], 0.3, eager)
            assert torch.equal(out[layer], eager)
            assert not out[layer, len(rows):].any()
            width = store.widths(run.rows)[layer]
            want = ragged_decode_attention(q[layer, : len(rows)], store.k, store.v, store.layer_ids(slots, layer, width),
                                           store.lengths[slots, layer], 0.3)
            torch.testing.assert_close(out[layer, : len(rows)].float(), want.float(), atol=2e-2, rtol=2e-2)
        store.decide_decode(run.rows, 0.0, WINDOW)
    assert store.table.relocated + store.table.packs > moved, "no row outgrew its capacity: the test proves less"


def shared_prefix_store(layers: int, prefix: int, seed: int, device: str = DEVICE):
    """A shared store where row 0 recorded a ``prefix``-token prompt and rows 1-3 adopted it (SGLang's radix cache
    giving one cached prefix to three more requests), random K/V at every entry; with the K/V writer."""
    store = SharedRaggedStore(layers * HEADS * 40, layers, HEADS, DIM, rows=4, width=8, slots=64, device=device)
    run = Run.__new__(Run)  # only its random K/V writer
    run.g, run.layers, run.device, run.dtype = torch.Generator().manual_seed(seed), layers, device, torch.float32
    run.store = store
    new = store.append([0], [prefix])
    run.write(new)
    slots = torch.arange(1, prefix + 1, device=device)  # SGLang's slot ids of the prompt's tokens
    assert store.record([0], [prefix], slots, new) == prefix
    store.adopt_all({row: slots for row in (1, 2, 3)})
    return store, run


@pytest.mark.parametrize("layers", [2, 4])
def test_rows_sharing_a_prefix_past_the_graphs_ids_attend_layer_by_layer(kernels, layers):
    """Requests that adopted one cached prefix (SGLang's radix cache) each list its entries, so a step's rows can hold
    more entry ids than the pool has entries (4 requests x 31 tokens x 2 heads x ``layers`` ids, of 80 · ``layers``
    entries). A graph's replay of such a step is refused (``graph_fits_hook`` sends it to the eager path); eagerly each
    layer's ids are copied before its attention: into the graphs' buffer where one layer's fit (4 layers: 248 ids of
    320), else into one layer's worth of ids of its own (2 layers: 248 of 160), never the whole step's. Every layer
    equals the formula."""
    prefix = 30
    store, run = shared_prefix_store(layers, prefix, seed=5)
    rows = [0, 1, 2, 3]
    new = store.append(rows, [1] * len(rows))
    run.write(new)
    buffers = DecodeBuffers(store, 5, GROUP, torch.float32, kernels=kernels, max_kv_splits=2, small_batch_splits=4)
    fixed = buffers.flat.kv_indices.data_ptr()
    layer_ids = len(rows) * (prefix + 1) * HEADS
    assert buffers.extent(rows)[1:] == (layer_ids * layers, layer_ids) and layer_ids * layers > store.capacity
    assert not buffers.fits_graph(rows) and buffers.fits_graph(rows[:1])
    with pytest.raises(RuntimeError, match="graphs' buffer"):
        buffers.layout(rows, new, 5, graphed=True)
    buffers.layout(rows, new, 5)
    own = buffers.flat.indices
    assert (own.data_ptr() == fixed) == (layer_ids < store.capacity) and own.numel() <= max(layer_ids, store.capacity) + 1
    slots = store.slots(rows)
    for layer in range(layers):
        q = run.randn(5, HEADS * GROUP, DIM)
        out = buffers.attend(layer, q, 0.3, torch.empty(5, HEADS * GROUP, DIM, device=DEVICE))
        width = store.widths(rows)[layer]
        want = ragged_decode_attention(q[:4], store.k, store.v, store.layer_ids(slots, layer, width),
                                       store.lengths[slots, layer], 0.3)
        torch.testing.assert_close(out[:4], want, **F32)
    assert buffers.flat.indices.data_ptr() == fixed and buffers.flat._by_layer is None  # let go after the last layer
    buffers.layout(rows[:1], new[:, :, :1], 2, graphed=True)  # a step that fits goes back to the graphs' buffer
    assert buffers.flat.indices.data_ptr() == fixed and buffers.flat._by_layer is None


@pytest.mark.gpu
def test_a_graph_replays_right_after_an_eager_step_laid_out_layer_by_layer(kernels):
    """On a GPU: a decode forward captured once (2 layers, a batch of 2); then an eager step of four rows sharing a
    cached prefix, past the graphs' ids (each layer's ids copied before its attention into ids of its own); then a
    step that fits, laid out for the graph and replayed. The replay reads the graphs' buffers again, not the eager
    step's ids: its output equals the float32 formula over the store's entries and the kernel run eagerly on the same
    buffers (bit for bit); the padding row gives zeros."""
    layers, prefix, batch = 2, 30, 2
    store, run = shared_prefix_store(layers, prefix, seed=11, device="cuda")
    buffers = DecodeBuffers(store, 5, GROUP, torch.float32, kernels=kernels, max_kv_splits=2, small_batch_splits=4)
    q = run.randn(layers, batch, HEADS * GROUP, DIM)
    k_new, v_new = run.randn(layers, batch, HEADS, DIM), run.randn(layers, batch, HEADS, DIM)
    out = torch.zeros(layers, batch, HEADS * GROUP, DIM, device="cuda")
    decode = buffers.capture_layout(batch)

    def forward():
        for layer in range(layers):
            write_entries(store, decode.new_ids[layer], k_new[layer], v_new[layer])
            buffers.attend(layer, q[layer], 0.3, out[layer])

    graph = captured(forward)
    fixed = buffers.flat.kv_indices.data_ptr()

    def check(rows, got, q_rows):
        slots = store.slots(rows)
        for layer in range(layers):
            want = ragged_decode_attention(q_rows[layer], store.k, store.v,
                                           store.layer_ids(slots, layer, store.widths(rows)[layer]),
                                           store.lengths[slots, layer], 0.3)
            torch.testing.assert_close(got[layer], want, **F32)

    rows = [0, 1, 2, 3]
    new = store.append(rows, [1] * len(rows))
    run.write(new)
    assert not buffers.fits_graph(rows)
    buffers.layout(rows, new, 5)  # eager: 248 ids per layer, past the graphs' 160
    eager_q = run.randn(layers, 5, HEADS * GROUP, DIM)
    assert buffers.flat.indices.data_ptr() != fixed
    got = [buffers.attend(layer, eager_q[layer], 0.3, torch.empty(5, HEADS * GROUP, DIM, device="cuda"))[:4]
           for layer in range(layers)]
    check(rows, got, eager_q[:, :4])
    new = store.append([0], [1])
    buffers.layout([0], new, batch, graphed=True)
    assert buffers.flat.indices.data_ptr() == fixed
    for t in (q, k_new, v_new):
        t.copy_(run.randn(*t.shape))
    graph.replay()
    check([0], out[:, :1], q[:, :1])
    assert not out[:, 1:].any()  # the padding row
    for layer in range(layers):
        eager = torch.empty_like(out[layer])
        buffers.attend(layer, q[layer], 0.3, eager)
        assert torch.equal(out[layer], eager)


def test_only_a_step_past_the_graphs_ids_is_sent_to_the_eager_path():
    """The AFTER hook on SGLang's ``DecodeCudaGraphRunner.can_run_graph``: False only where SGLang would replay and
    the ragged backend (the process's, whatever object the runner holds) says the step does not fit; SGLang's own
    refusals and a process without the backend are left alone."""
    from types import SimpleNamespace

    from kvzap_export.integrations.sglang.ragged_decode import graph_fits_hook

    def parts(fits):
        return SimpleNamespace(backend=SimpleNamespace(decode_fits_graph=lambda: fits))

    runner = SimpleNamespace(attn_backend=object())  # e.g. a wrapper SGLang built around the backend
    assert graph_fits_hook(parts(False), True, runner, None) is False
    assert graph_fits_hook(parts(True), True, runner, None) is None
    assert graph_fits_hook(parts(False), False, runner, None) is None
    assert graph_fits_hook(SimpleNamespace(backend=None), True, runner, None) is None
