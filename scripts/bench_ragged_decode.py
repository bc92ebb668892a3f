#!/usr/bin/env python
"""GPU benchmark of ragged decode attention (docs/ragged-kv.md) and of one decoder layer's decode step, dense vs
ragged, in CUDA graphs. Llama-3.1-8B shapes: 32 query heads, 8 KV heads, head dim 128, hidden 4096, FFN 14336, bf16.

    python scripts/bench_ragged_decode.py --json out.json --sglang-kernels sglang-0.5.23-....whl

Sections (each in try/except: an error is recorded in the JSON and the next section runs):

- exactness: every attention path timed here against ``ragged_attention.ragged_decode_attention`` (the float32
  formula) on one case with ragged lengths and empty heads;
- attention: batch 1/16/64 x T 4096/32768 x pruned 0.4/0.7. Dense over a full [B, 8, T, 128] cache: SDPA in two
  query layouts and SGLang's kernel (``dense_variants``, ``DenseThroughKernel``); the fastest is the ratios'
  baseline. SDPA over the kept length (the ideal). Ragged (lengths within +-25% of the mean, entries shuffled in one
  pool): the engine's path (``StepAttention``: ``FlattenedStep``'s layout of the layer, then SGLang's kernel; the
  default row, with the kernel alone beside it), ``FlattenedDecode`` (torch-op layout per call; split settings swept
  at a few rows), our first Triton kernel at a few rows (eager, few repetitions). The last two run nowhere else:
  they live beside this benchmark (``kvzap_export/bench/flattened_decode.py``, ``triton_ragged_attention.py``);
- layer: one decoder layer's decode step (``kvzap_export/bench/ragged_step.py``), dense (each dense attention; the
  fastest is the baseline) vs ragged (K/V and score writes, layout, SGLang's kernel, decision and free-stack
  kernels), each in one CUDA graph; eager too;
- replay (before parts, so that no time budget cuts it): 50 replays of the captured ragged step (lengths growing,
  heads pruned) against the same 50 steps run eagerly from the same state: bookkeeping (ids, lengths, free stack,
  next ids) equal, outputs and K/V/score stores within 1e-2;
- parts: the step's parts (front, K/V write, scoring, layout, attention, back, decisions; dense and ragged), each in
  its own CUDA graph, batch 16 x 32k, the kernel named per row.

Split settings: the engine's on a GPU (``kernels/flattened_step.py``: 32 per row, 64 at steps of at most 4
requests, policy "proportional"). Rows past ``--budget-s`` seconds are skipped (listed under "skipped").

Timing: CUDA events around CUDA graph replays (the old kernel and the eager columns: direct calls), a 256 MiB write
between calls (L2 flush), median of --reps; GB/s counts K and V rows read once (plus int32 ids for ragged rows).
Targets are printed and recorded (informational). Without a CUDA GPU: one line, exit 2. Exit 1 if an exactness or
replay check failed, 3 if a section raised.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kvzap_export.bench.timing import capture_graph, flushed_timer  # noqa: E402
from kvzap_export.bench import ragged_step as model  # noqa: E402 - shapes, dtype, device: model.NAME (one owner)
from kvzap_export.bench import ragged_report  # noqa: E402
from kvzap_export.bench.ragged_report import print_report  # noqa: E402 - the script's printer (its tests call it here)
from kvzap_export.kernels.flattened_step import GPU_SMALL_BATCH_SPLITS, GPU_SPLITS  # noqa: E402
from kvzap_export.bench.ragged_step import (  # noqa: E402
    DenseThroughKernel, Layer, RaggedState, StepAttention, dense_step, dense_variants, kept_lengths, pool_layout,
    ragged_decide, ragged_score, ragged_step, ragged_write, replay_against_eager)

ATTENTION_GRID = [(b, t, p) for b in (1, 16, 64) for t in (4096, 32768) for p in (0.4, 0.7)]
OLD_KERNEL_ROWS = {(1, 32768, 0.7), (16, 32768, 0.7), (64, 4096, 0.7)}
SWEEP_ROWS = {(1, 32768, 0.7): [("max", 32), ("proportional", 64), ("max", 64)],
              (16, 32768, 0.7): [("max", 32), ("proportional", 64)], (16, 32768, 0.4): [("max", 32)]}
LAYER_GRID = [(16, 32768, 0.4), (16, 32768, 0.7), (1, 32768, 0.7), (64, 4096, 0.7), (1, 32768, 0.4), (64, 4096, 0.4)]
PARTS_GRID = [(16, 32768, 0.7), (16, 32768, 0.4)]  # the layer step's parts, each in its own graph
EXACT_CASE = (3, 32768, 0.4)  # batch, T, pruned of the exactness check
REPLAY_CASE = (16, 32768, 0.7, 50)  # batch, T, pruned, steps of the replay check
SPLITS, SMALL_BATCH_SPLITS = GPU_SPLITS, GPU_SMALL_BATCH_SPLITS  # the engine's split settings on a GPU
FLUSH_BYTES = 256 << 20


def device_name() -> str:
    return torch.cuda.get_device_name()


def free_memory() -> int:
    return torch.cuda.mem_get_info()[0]


def allocation_count() -> int:
    return torch.cuda.memory_stats()["allocation.all.allocated"]


def release() -> None:
    """Hands cached blocks back between rows (batch 64 x 32k holds gigabytes)."""
    torch.cuda.empty_cache()


# ---- measuring -------------------------------------------------------------------------------------------------
def timer(flush, warmup: int, reps: int):
    """Median seconds per call, CUDA events, L2 flushed before each (``bench.timing.flushed_timer``)."""
    return flushed_timer(flush, warmup, reps)


def graphed(fn):
    """``fn`` captured in a CUDA graph (after two warm-up calls on a side stream); returns (graph, its output)."""
    return capture_graph(fn, warmups=2)


class Bench:
    def __init__(self, args, kernels):
        from kvzap_export.bench.flattened_decode import FlattenedDecode

        self.args, self.kernels, self.FlattenedDecode = args, kernels, FlattenedDecode
        self.device_name = device_name()
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=model.DEVICE)
        self.measure = timer(self.flush, args.warmup, args.reps)
        self.started = time.perf_counter()
        self.report = {"device": self.device_name, "torch": torch.__version__, "cuda": torch.version.cuda,
                       "kernel_source": kernels.source.as_dict(), "exactness": [], "attention": [], "layer": [], "parts": [],
                       "replay": None, "targets": [], "errors": [], "skipped": []}

    def graphed_time(self, fn) -> float:
        """Median seconds of ``fn`` replayed from a CUDA graph: the launches' host overhead out, as an engine decodes."""
        graph, _ = graphed(fn)
        try:
            return self.measure(graph.replay)
        finally:
            del graph

    def over_budget(self) -> bool:
        return time.perf_counter() - self.started > self.args.budget_s

    def flattened(self, batch, width, policy="proportional", splits=None):
        splits = splits or SPLITS
        return self.FlattenedDecode(batch, model.KV_HEADS, model.Q_HEADS // model.KV_HEADS, model.HEAD_DIM, width,
                                    dtype=model.DTYPE, device=model.DEVICE, max_kv_splits=splits,
                                    split_policy=policy, kernels=self.kernels)

    def _engine_kernel(self, cls, batch, size):
        """``cls(batch, heads, group, head dim, size, ...)`` with the engine's split settings on a GPU."""
        return cls(batch, model.KV_HEADS, model.Q_HEADS // model.KV_HEADS, model.HEAD_DIM, size, dtype=model.DTYPE,
                   device=model.DEVICE, kernels=self.kernels, max_kv_splits=SPLITS, small_batch_splits=SMALL_BATCH_SPLITS)

    def step_attention(self, batch, entries):
        """The engine's path (``StepAttention``: ``FlattenedStep``'s layout of one layer, then SGLang's kernel)."""
        return self._engine_kernel(StepAttention, batch, entries)

    def dense_kernel(self, batch, seq):
        """Dense attention through SGLang's kernel over a full [B, 8, T, 128] cache (``DenseThroughKernel``)."""
        return self._engine_kernel(DenseThroughKernel, batch, seq)

    def row(self, **fields):
        return {"device": self.device_name, **fields}

    # -- exactness ---------------------------------------------------------------------------------------------
    def exactness(self):
        from kvzap_export.kernels.ragged_attention import ragged_decode_attention
        from kvzap_export.bench.triton_ragged_attention import ragged_decode_attention_triton

        g = torch.Generator(device=model.DEVICE).manual_seed(1)
        batch, seq, pruned = EXACT_CASE
        lengths = kept_lengths(batch, model.KV_HEADS, seq, pruned, g)
        lengths[0, -1], lengths[-1] = 0, 0  # an empty head, an empty request
        ids, total = pool_layout(lengths, int(lengths.max()), g)
        k = torch.randn(total, model.HEAD_DIM, device=model.DEVICE, generator=g, dtype=model.DTYPE)
        v = torch.randn(total, model.HEAD_DIM, device=model.DEVICE, generator=g, dtype=model.DTYPE)
        q = torch.randn(batch, model.Q_HEADS, model.HEAD_DIM, device=model.DEVICE, generator=g)
        q = (3 * q).to(model.DTYPE)  # peaked softmax
        want = ragged_decode_attention(q, k, v, ids, lengths, 1 / math.sqrt(model.HEAD_DIM)).float()
        kernels = {f"sglang-flattened {p} splits {s}": self.flattened(batch, ids.shape[-1], p, s)
                   for p, s in [("proportional", SPLITS), ("max", SPLITS), ("proportional", 2 * SPLITS)]}
        kernels["sglang-step (engine layout)"] = self.step_attention(batch, total)
        kernels["triton-ragged (ours)"] = ragged_decode_attention_triton
        for name, fn in kernels.items():
            got = fn(q, k, v, ids, lengths, 1 / math.sqrt(model.HEAD_DIM)).float()
            err = (got - want).abs()
            ok = bool(torch.isfinite(got).all()) and bool((err <= 2e-3 + 2e-2 * want.abs()).all())
            case = f"batch {batch}, T {seq}, pruned {pruned}, empty heads"
            self.report["exactness"].append(self.row(kernel=name, case=case, max_abs_err=err.max().item(),
                                                     max_abs_ref=want.abs().max().item(), passed=ok))

    # -- attention ---------------------------------------------------------------------------------------------
    def attention(self):
        from kvzap_export.bench.triton_ragged_attention import ragged_decode_attention_triton

        scale = 1 / math.sqrt(model.HEAD_DIM)
        for batch, seq in sorted({(b, t) for b, t, _ in ATTENTION_GRID}):
            need = 2 * batch * model.KV_HEADS * seq * model.HEAD_DIM * 2 * 2.5  # dense K/V, the pool, the kept tensors
            if need > free_memory() or self.over_budget():
                self.report["skipped"].append(f"attention batch {batch} T {seq}: memory or time budget")
                continue
            g = torch.Generator(device=model.DEVICE).manual_seed(batch * seq)
            kd = torch.randn(batch, model.KV_HEADS, seq, model.HEAD_DIM, device=model.DEVICE, generator=g,
                             dtype=model.DTYPE)
            vd = torch.randn_like(kd)
            q = torch.randn(batch, model.Q_HEADS, model.HEAD_DIM, device=model.DEVICE, generator=g).to(model.DTYPE)
            through = self.dense_kernel(batch, seq)
            sdpa_fns = dense_variants()
            times = {name: self.graphed_time(lambda f=f: f(q, kd, vd, scale)) for name, f in sdpa_fns.items()}
            times["sglang-dense"] = self.graphed_time(lambda: through(q, kd, vd, scale))
            del through
            dense = min(times.values())  # the ratios' baseline: the fastest dense attention
            sdpa_name = min(sdpa_fns, key=times.get)
            dense_bytes = 2 * batch * model.KV_HEADS * seq * model.HEAD_DIM * 2
            for name, t in times.items():
                self.report["attention"].append(self.row(kernel=name, batch=batch, seq=seq, pruned=0.0, time_us=t * 1e6,
                                                         gbps=dense_bytes / t / 1e9, ratio=t / dense,
                                                         baseline=t == dense))
            for pruned in (0.4, 0.7):
                lengths = kept_lengths(batch, model.KV_HEADS, seq, pruned, g)
                ids, total = pool_layout(lengths, int(lengths.max()), g)
                ks = torch.randn(total, model.HEAD_DIM, device=model.DEVICE, generator=g, dtype=model.DTYPE)
                vs = torch.randn_like(ks)
                kept = round((1 - pruned) * seq)
                base = dict(batch=batch, seq=seq, pruned=pruned, entries=total)
                ideal = self.graphed_time(lambda: sdpa_fns[sdpa_name](q, kd[:, :, :kept], vd[:, :, :kept], scale))
                self.report["attention"].append(self.row(kernel=f"{sdpa_name} over the kept length", **base,
                                                         time_us=ideal * 1e6, ratio=ideal / dense,
                                                         gbps=dense_bytes * kept / seq / ideal / 1e9))
                ragged_bytes = total * (2 * model.HEAD_DIM * 2 + 4)
                rows = [("sglang-step", self.step_attention(batch, total), {"default": True})]
                rows += [("sglang-flattened", self.flattened(batch, ids.shape[-1], policy, splits),
                          {"policy": policy, "max_kv_splits": splits, "default": False})
                         for policy, splits in [("proportional", SPLITS)] + SWEEP_ROWS.get((batch, seq, pruned), [])]
                for name, attend, extra in rows:
                    both = self.graphed_time(lambda: attend(q, ks, vs, ids, lengths, scale))
                    attend.fill(ids, lengths)
                    alone = self.graphed_time(lambda: attend.attend(q, ks, vs, scale))
                    before = allocation_count()
                    attend(q, ks, vs, ids, lengths, scale)
                    self.report["attention"].append(self.row(
                        kernel=name, **base, time_us=both * 1e6, kernel_only_us=alone * 1e6, ratio=both / dense,
                        kernel_only_ratio=alone / dense, gbps=ragged_bytes / both / 1e9,
                        allocations_per_call=allocation_count() - before, **extra))
                del rows, attend
                if (batch, seq, pruned) in OLD_KERNEL_ROWS and not self.over_budget():
                    slow = lambda: ragged_decode_attention_triton(q, ks, vs, ids, lengths, scale)  # noqa: E731
                    old = timer(self.flush, 1, 5)(slow)
                    self.report["attention"].append(self.row(kernel="triton-ragged (ours)", **base, time_us=old * 1e6,
                                                             ratio=old / dense, gbps=ragged_bytes / old / 1e9))
                del ks, vs, ids
            del kd, vd
            release()

    # -- one layer's step ----------------------------------------------------------------------------------------
    def ragged_setup(self, batch, seq, pruned, seed):
        g = torch.Generator(device=model.DEVICE).manual_seed(seed)
        lengths = kept_lengths(batch, model.KV_HEADS, seq, pruned, g).clamp(min=model.WINDOW + 1)
        ids, total = pool_layout(lengths, int(lengths.max()), g)
        steps = 4 * (self.args.warmup + self.args.reps) + 60  # every call below appends one token per head
        st = RaggedState(lengths, ids, total, model.HEAD_DIM, model.DTYPE, g, spare_steps=steps)
        flat = self.step_attention(batch, st.k.shape[0])
        x = torch.randn(batch, model.HIDDEN, device=model.DEVICE, generator=g).to(model.DTYPE)
        return st, flat, x

    def layer_case(self, section, batch, seq, pruned, seed):
        """A dense cache [B, 8, T, 128] (K, V) and a ragged state for one row of ``section``; None (recorded as
        skipped) past the time budget."""
        if self.over_budget():
            self.report["skipped"].append(f"{section} batch {batch} T {seq} pruned {pruned}: time budget")
            return None
        g = torch.Generator(device=model.DEVICE).manual_seed(seed)
        kd = torch.randn(batch, model.KV_HEADS, seq, model.HEAD_DIM, device=model.DEVICE, generator=g,
                         dtype=model.DTYPE)
        return (kd, torch.randn_like(kd), *self.ragged_setup(batch, seq, pruned, seed + 1))

    def layer(self):
        layer = Layer()
        for batch, seq, pruned in LAYER_GRID:
            case = self.layer_case("layer", batch, seq, pruned, 7)
            if case is None:
                continue
            kd, vd, st, flat, x = case
            through = self.dense_kernel(batch, seq)
            attends = {**dense_variants(), "sglang-dense": through}
            dense_fns = {name: lambda a=a: dense_step(layer, kd, vd, x, attend=a) for name, a in attends.items()}
            ragged_fn = lambda: ragged_step(layer, st, x, flat, self.args.tau)  # noqa: E731
            eager = {name: self.measure(fn) for name, fn in dense_fns.items()}
            dense = {name: self.graphed_time(fn) for name, fn in dense_fns.items()}
            ragged_eager, ragged_g = self.measure(ragged_fn), self.graphed_time(ragged_fn)
            best = min(dense, key=dense.get)  # the baseline: the faster dense step, graphed
            self.report["layer"].append(self.row(
                kernel="sglang-step", batch=batch, seq=seq, pruned=pruned, entries=int(st.lengths.sum()),
                dense_baseline=best, dense_graph_us=dense[best] * 1e6, ragged_graph_us=ragged_g * 1e6,
                ratio=ragged_g / dense[best], dense_eager_us=eager[best] * 1e6, ragged_eager_us=ragged_eager * 1e6,
                ratio_eager=ragged_eager / eager[best],
                **{f"{name}_graph_us": t * 1e6 for name, t in dense.items()},
                **{f"{name}_eager_us": t * 1e6 for name, t in eager.items()}))
            del kd, vd, st, flat, through
            release()

    def parts(self):
        """One layer's decode step cut into its parts, each captured alone in a CUDA graph and timed, dense and ragged:
        front (norm, QKV), K/V write (ragged: and the rows' append), scoring (the surrogate and its score write; ragged
        only), attention (dense: SDPA, and SGLang's kernel, over the whole cache; ragged: the layout of the layer's rows
        (``FlattenedStep.fill``, which the engine does once per step for every layer) and SGLang's kernel over them),
        back (O, norm, FFN), decisions (ragged only: the decision kernel, the free stack pushed and popped). Every part
        reads static inputs made by one eager pass; the ragged state has room for every call."""
        layer = Layer(seed=5)
        for batch, seq, pruned in PARTS_GRID:
            case = self.layer_case("parts", batch, seq, pruned, 9)
            if case is None:
                continue
            kd, vd, st, flat, x = case
            through = self.dense_kernel(batch, seq)
            h, q, k, v = layer.front(x)
            attn = flat(q, st.k, st.v, st.ids, st.lengths, layer.scale).clone()

            def dense_write():
                kd[:, :, -1] = k
                vd[:, :, -1] = v

            common = {"front": lambda: layer.front(x), "back": lambda: layer.back(x, attn.reshape(batch, -1))}
            attends = {**dense_variants(), "sglang-dense": through}
            dense = {**common, "kv_write": dense_write,
                     **{f"attention ({name})": lambda a=a: a(q, kd, vd, layer.scale) for name, a in attends.items()}}
            # layout and attention first (before kv_write appends to the rows)
            ragged = {"layout": lambda: flat.fill(st.ids, st.lengths),
                      "attention": lambda: flat.attend(q, st.k, st.v, layer.scale), **common,
                      "scoring": lambda: ragged_score(layer, st, h), "kv_write": lambda: ragged_write(st, k, v),
                      "decisions": lambda: ragged_decide(st, self.args.tau)}
            kernels = {f"attention ({name})": name for name in attends}  # the other parts: no attention kernel
            for mode, parts in (("dense", dense), ("ragged", ragged)):
                for part, fn in parts.items():
                    self.report["parts"].append(self.row(
                        kernel=kernels.get(part, mode if mode == "dense" else "sglang-step"), mode=mode, part=part,
                        batch=batch, seq=seq, pruned=pruned, graph_us=self.graphed_time(fn) * 1e6))
            del kd, vd, st, flat, through
            release()

    def replay(self):
        """The captured ragged step replayed ``steps`` times vs the same steps eagerly (``replay_against_eager``)."""
        batch, seq, pruned, steps = REPLAY_CASE
        st, flat, x = self.ragged_setup(batch, seq, pruned, 11)
        figures = replay_against_eager(Layer(seed=3), st, flat, x, self.args.tau, steps, graphed)
        self.report["replay"] = self.row(kernel="sglang-step", batch=batch, seq=seq, pruned=pruned, steps=steps,
                                         **figures)

    def targets(self):
        self.report["targets"] = ragged_report.targets(self.report, self.device_name)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--sglang-kernels", help="the sglang 0.5.23 wheel or a directory holding sglang/kernels/ops/"
                                                 "attention/decode_attention.py (default: the installed sglang)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tau", type=float, default=0.0, help="threshold of the layer step's decisions")
    parser.add_argument("--budget-s", type=float, default=110.0, help="skip remaining rows past this many seconds")
    parser.add_argument("--only", default="exactness,attention,layer,replay,parts")
    return parser.parse_args(argv)


def run(args, kernels) -> tuple[dict, int]:
    """Every section of ``args.only``, each in try/except; returns (report, exit code: 1 if an exactness or replay
    check failed, 3 if a section raised, else 0). With ``--json`` the report is written after every section, so a
    run stopped from outside keeps what it measured."""
    bench = Bench(args, kernels)
    for section in args.only.split(","):
        try:
            getattr(bench, section)()
        except Exception as error:  # noqa: BLE001 - recorded, the next section runs
            bench.report["errors"].append({"section": section, "error": f"{type(error).__name__}: {error}",
                                           "traceback": traceback.format_exc()})
            release()
        if args.json:
            args.json.write_text(json.dumps({**bench.report, "partial": True}, indent=2))
    bench.targets()
    bench.report["elapsed_s"] = time.perf_counter() - bench.started
    replay = bench.report["replay"]
    exact = [r["passed"] for r in bench.report["exactness"]] + ([replay["passed"]] if replay else [])
    return bench.report, 1 if not all(exact) else 3 if bench.report["errors"] else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ragged_decode: needs a CUDA GPU; none is visible to torch on this machine", file=sys.stderr)
        return 2
    from kvzap_export.errors import KvzapError
    from kvzap_export.kernels import sglang_kernels

    try:
        kernels = sglang_kernels.load(args.sglang_kernels)
    except KvzapError as error:
        print(f"bench_ragged_decode: {error}", file=sys.stderr)
        return 2
    report, code = run(args, kernels)
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return code


if __name__ == "__main__":
    sys.exit(main())
