"""scripts/bench_ragged_decode.py (ragged decode attention and one layer's step, dense vs ragged, in CUDA graphs) on
the CPU.

Its only real run is on a GPU machine; here its parts that need no GPU run on CPU tensors: the layouts, the dense and
the ragged layer step (attention through the torch path of ``ragged_attention``, and through SGLang's kernel in
Triton's interpreter where its file is found), the step's bookkeeping against a model written with Python lists, the
report's targets and printing, and the refusal without a GPU. CUDA graphs, timings and bf16 are not exercised here.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvzap_export.kernels.ragged_attention import decode_attention, ragged_decode_attention

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_ragged_decode.py"
INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="runs SGLang's kernel on CPU tensors: needs Triton's interpreter (no GPU)")
SMALL = dict(hidden=64, q_heads=8, kv_heads=2, head_dim=16, ffn=96, surrogate_hidden=32, dtype=torch.float32,
             device="cpu")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_ragged_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def state(bench, lengths, seed=0, spare=40):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths, dtype=torch.int32)
    ids, total = bench.pool_layout(lengths, int(lengths.max()), g)
    return bench.RaggedState(lengths, ids, total, 16, torch.float32, g, spare_steps=spare)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible: the script would run")
def test_without_a_gpu_it_refuses_in_one_line():
    done = subprocess.run([sys.executable, str(SCRIPT), "--json", os.devnull], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "needs a CUDA GPU" in done.stderr


def test_layouts_give_each_head_its_own_shuffled_entries(bench):
    g = torch.Generator().manual_seed(0)
    lengths = bench.kept_lengths(16, 8, 4096, 0.7, g)
    assert lengths.dtype == torch.int32 and lengths.shape == (16, 8)
    assert int(lengths.min()) >= round(0.75 * 0.3 * 4096) and int(lengths.max()) <= round(1.25 * 0.3 * 4096)
    ids, total = bench.pool_layout(lengths, int(lengths.max()) + 3, g)
    held = torch.arange(ids.shape[-1]) < lengths[..., None]
    assert total == int(lengths.sum()) and torch.equal(ids[held].sort().values, torch.arange(total, dtype=torch.int32))
    assert bool((ids[~held] == 0).all())
    assert not torch.equal(ids[held], torch.arange(total, dtype=torch.int32))  # shuffled, not contiguous


def test_ragged_step_equals_the_dense_step_over_the_same_entries(bench):
    """Every head holding L entries (shuffled in the pool): the ragged step's output equals the dense step's over a
    cache of those entries plus the new token (attention sees the token before any decision)."""
    layer = bench.Layer(**SMALL)
    st = state(bench, [[150, 150], [150, 150], [150, 150]])
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    held = st.ids[..., :150].long()
    k_cache = torch.cat([st.k[held], torch.zeros(3, 2, 1, 16)], 2)
    v_cache = torch.cat([st.v[held], torch.zeros(3, 2, 1, 16)], 2)
    want = bench.dense_step(layer, k_cache, v_cache, x)
    for attend in (decode_attention, ragged_decode_attention):
        got = bench.ragged_step(layer, st.clone(), x, attend, tau=0.0)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_ragged_step_bookkeeping_follows_a_list_model(bench):
    """30 steps: each head's row gets the token's entry, the entry leaving the 128-token window is removed when its
    score is below tau; every entry id is in exactly one place (a row, the free stack, the next step's ids)."""
    layer = bench.Layer(**SMALL)
    st = state(bench, [[129, 200], [140, 131]], spare=40)
    E = st.k.shape[0]
    rows = [[st.ids[b, h, : st.lengths[b, h]].tolist() for h in range(2)] for b in range(2)]
    g = torch.Generator().manual_seed(2)
    evicted = 0
    for _ in range(30):
        fresh = st.fresh.clone()
        bench.ragged_step(layer, st, torch.randn(2, 64, generator=g), decode_attention, tau=0.0)
        for b in range(2):
            for h in range(2):
                row = rows[b][h]
                row.append(int(fresh[b, h]))
                if len(row) >= bench.WINDOW + 1 and float(st.scores[row[len(row) - bench.WINDOW - 1]]) < 0.0:
                    del row[len(row) - bench.WINDOW - 1]
                    evicted += 1
                assert st.ids[b, h, : st.lengths[b, h]].tolist() == row
        places = [i for r in rows for row in r for i in row] + st.free[: int(st.top)].tolist() + st.fresh.flatten().tolist()
        assert sorted(places) == list(range(E))
    assert evicted > 10  # heads were pruned while their rows grew


def test_state_copies_keep_the_buffers(bench):
    st = state(bench, [[130, 135]])
    pointers = {name: t.data_ptr() for name, t in st.__dict__.items()}
    other = st.clone()
    assert all(other.__dict__[n].data_ptr() != p for n, p in pointers.items())
    st.lengths.add_(5)
    st.copy_(other)
    assert torch.equal(st.lengths, other.lengths)
    assert {name: t.data_ptr() for name, t in st.__dict__.items()} == pointers


@INTERPRETED
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_ragged_step_through_sglangs_kernel_in_the_interpreter(bench):
    """The step with attention through ``FlattenedDecode`` (SGLang's kernel, Triton's interpreter, float32) gives
    what it gives through the torch path."""
    from tests.kernels.test_flattened_attention import kernel_source

    from kvzap_export.kernels import sglang_kernels
    from kvzap_export.kernels.flattened_attention import FlattenedDecode

    source = kernel_source()
    if source is None:
        pytest.skip("needs SGLang's kernel file (see tests/kernels/test_flattened_attention.py)")
    layer = bench.Layer(**SMALL)
    st = state(bench, [[129, 170], [133, 140]], spare=6)
    flat = FlattenedDecode(2, 2, 4, 16, st.ids.shape[-1], dtype=torch.float32, device="cpu", max_kv_splits=4,
                           kernels=sglang_kernels.load(source or None))
    twin = st.clone()
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        x = torch.randn(2, 64, generator=g)
        got = bench.ragged_step(layer, st, x, flat, tau=0.0)
        want = bench.ragged_step(layer, twin, x, decode_attention, tau=0.0)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(st.lengths, twin.lengths) and torch.equal(st.ids, twin.ids)


class ReplayedByCalling:
    """Stands in for a CUDA graph on the CPU: ``replay`` calls the function again (plumbing only: an eager-vs-replay
    comparison through it compares eager with eager)."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        self.out.copy_(self.fn())


@INTERPRETED
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_every_section_runs_on_cpu_tensors(bench, monkeypatch, capsys):
    """The whole script, sections and report, at tiny shapes in float32 on the CPU: SGLang's kernel and our Triton
    kernel in the interpreter, a wall clock for CUDA events, ``ReplayedByCalling`` for graphs. Checks the plumbing
    (rows, kernels named, exactness verdicts, the report serialisable); timings mean nothing here."""
    import json
    import time

    from tests.kernels.test_flattened_attention import kernel_source

    from kvzap_export.kernels import sglang_kernels

    source = kernel_source()
    if source is None:
        pytest.skip("needs SGLang's kernel file (see tests/kernels/test_flattened_attention.py)")
    for name, value in dict(DEVICE="cpu", DTYPE=torch.float32, FLUSH_BYTES=1024, Q_HEADS=8, KV_HEADS=2, HEAD_DIM=16,
                            HIDDEN=64, FFN=96, SURROGATE_HIDDEN=32, ATTENTION_GRID=[(2, 512, 0.4), (2, 512, 0.7)],
                            OLD_KERNEL_ROWS={(2, 512, 0.7)}, SWEEP_ROWS={(2, 512, 0.7): [("max", 4)]}, SPLITS=2,
                            LAYER_GRID=[(2, 512, 0.7)], EXACT_CASE=(2, 512, 0.4), REPLAY_CASE=(2, 512, 0.7, 4),
                            TARGETS=[("attention", 2, 512, 0.7, 0.5), ("layer", 2, 512, 0.7, 0.65)]).items():
        monkeypatch.setattr(bench, name, value)
    monkeypatch.setattr(bench, "device_name", lambda: "cpu (test)")
    monkeypatch.setattr(bench, "free_memory", lambda: 1 << 40)
    monkeypatch.setattr(bench, "allocation_count", lambda: 0)
    bench.release()  # the real one returns (it once called itself: a RecursionError at the first attention row)
    monkeypatch.setattr(bench, "release", lambda: None)

    def wall_clock(flush, warmup, reps):
        def measure(fn):
            start = time.perf_counter()
            fn()
            return max(time.perf_counter() - start, 1e-9)
        return measure

    monkeypatch.setattr(bench, "timer", wall_clock)
    monkeypatch.setattr(bench, "graphed", lambda fn: (ReplayedByCalling(fn, out := fn()), out))
    args = bench.parse_args(["--reps", "1", "--warmup", "0"])
    report, code = bench.run(args, sglang_kernels.load(source or None))
    assert report["errors"] == [] and code == 0, report["errors"]
    assert [r["passed"] for r in report["exactness"]] == [True] * 4
    kernels = [(r["kernel"], r["pruned"]) for r in report["attention"]]
    assert kernels == [("sdpa-dense", 0.0), ("sdpa-kept", 0.4), ("sglang-flattened", 0.4), ("sdpa-kept", 0.7),
                       ("sglang-flattened", 0.7), ("sglang-flattened", 0.7), ("triton-ragged (ours)", 0.7)]
    rows = report["attention"] + report["layer"] + report["exactness"] + [report["replay"]]
    assert all(r["device"] == "cpu (test)" and r["kernel"] for r in rows)
    assert report["replay"]["passed"] and report["replay"]["bookkeeping_equal"]
    assert report["replay"]["evicted_fraction"] > 0  # heads were pruned during the replayed steps
    assert [t["name"].split(":")[0] for t in report["targets"]] == ["attention batch 2 T 512 pruned 0.7",
                                                                    "layer batch 2 T 512 pruned 0.7"]
    json.dumps(report)
    bench.print_report(report)
    assert "replay" in capsys.readouterr().out


def test_targets_and_report(bench, capsys):
    fake = object.__new__(bench.Bench)
    fake.device_name = "CPU stand-in"
    fake.report = {"device": "CPU stand-in", "kernel_source": {"origin": "wheel", "location": "x.whl", "stood_in": {}},
                   "exactness": [{"kernel": "k", "max_abs_err": 1e-4, "max_abs_ref": 1.0, "passed": True}],
                   "attention": [{"kernel": "sglang-flattened", "policy": "proportional", "max_kv_splits": 32,
                                  "batch": 16, "seq": 32768, "pruned": 0.7, "time_us": 300.0, "ratio": 0.43,
                                  "gbps": 2000.0, "default": True},
                                 {"kernel": "sglang-flattened", "policy": "max", "max_kv_splits": 32, "batch": 16,
                                  "seq": 32768, "pruned": 0.4, "time_us": 600.0, "ratio": 0.7, "gbps": 2000.0,
                                  "default": False}],
                   "layer": [{"batch": 16, "seq": 32768, "pruned": 0.4, "dense_graph_us": 900.0,
                              "ragged_graph_us": 900.0, "ratio": 1.0, "dense_eager_us": 1.0, "ragged_eager_us": 1.0}],
                   "replay": None, "targets": [], "errors": [{"section": "layer", "error": "RuntimeError: x"}]}
    fake.targets()
    verdicts = {t["name"].split(":")[0]: t["passed"] for t in fake.report["targets"]}
    assert verdicts == {"attention batch 16 T 32768 pruned 0.7": True, "attention batch 16 T 32768 pruned 0.4": None,
                        "attention batch 1 T 32768 pruned 0.7": None, "layer batch 16 T 32768 pruned 0.7": None,
                        "layer batch 16 T 32768 pruned 0.4": False}
    bench.print_report(fake.report)
    printed = capsys.readouterr().out
    assert "ERROR in layer" in printed and "x0.43 dense" in printed


def test_arguments(bench):
    args = bench.parse_args(["--sglang-kernels", "w.whl", "--reps", "5", "--only", "attention"])
    assert (args.sglang_kernels, args.reps, args.only, args.budget_s) == ("w.whl", 5, "attention", 110.0)
