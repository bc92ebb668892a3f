"""Decision level: keep masks from the reference's scores vs from each exported backend's scores.

Over several sequences (about 2.4k tokens per layer, real or synthetic hidden states). Only positions
before the window can be evicted, so only their decisions can flip: they are counted apart. A flip is
*explained* when the reference score lies within ``flip_tolerance`` of τ (the two computations rounded
differently at the last bits), *unexplained* otherwise: the bar is zero unexplained flips. Explained flips
are bounded too: at most ``FLIP_BUDGET`` of the decisions that can flip (see its comment).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvzap_export.export.dtypes import TORCH_DTYPES
from kvzap_export.surrogate.model import Surrogate
from kvzap_export.validate.checks import Check, skipped
from kvzap_export.validate.device import Device
from kvzap_export.validate.hidden import HiddenStates
from kvzap_export.validate.operator_level import exported_runners

# A decision flip is "explained" when the reference score lies within this distance of τ
# (a few units in the last place of the dtype at |τ|); otherwise it is a bug.
FLIP_ULPS = 8
# Explained flips allowed, as a fraction of the decisions that can flip (positions before the window). Within
# the band a flip means the two computations rounded differently in the last bits (accumulation order, bf16
# rounding of an intermediate); on SmolLM2 that happens for none of ~57k decisions in float32 and bfloat16.
# More than 1% would mean the graph rounds systematically unlike the reference (a cast or an accumulation in
# another dtype), which must fail even when each flip alone lies near τ.
FLIP_BUDGET = 0.01


def flip_tolerance(dtype: str, threshold: float) -> float:
    eps = torch.finfo(TORCH_DTYPES[dtype]).eps
    return FLIP_ULPS * eps * max(1.0, abs(threshold))


def check_decisions(bundle, manifest: dict, surrogate: Surrogate, hidden: HiddenStates, backends, device: Device | None = None,
                    plugin_libraries: tuple[str, ...] = (), on_step: Callable[[], None] | None = None) -> tuple[Check, dict]:
    """Every surrogate artifact's decisions on every sequence of ``hidden`` vs the reference's (on ``device``)."""
    from kvzap_export.ops import threshold_compaction

    device = device or Device("cpu")
    dtype = manifest["dtype"]
    torch_dtype = TORCH_DTYPES[dtype]
    feed_dtype = np.float32 if dtype == "bfloat16" else np.dtype(dtype)
    pruning = manifest["pruning"]
    tau, window, sink = pruning["threshold"], pruning["window"], pruning["sink"]
    tol = flip_tolerance(dtype, tau)
    layers = [a for a in manifest["artifacts"] if a["kind"] == "surrogate_layer"]
    if not any(b in backends for b in ("onnxrt", "trt")):
        return skipped("decision:keep_masks", "decision", "no exported backend requested (onnxrt or trt)"), {}
    reference = surrogate.to(device.torch_device)
    counts = dict(decisions=0, outside_window=0, flips=0, explained=0, unexplained=0, kept=0, reference_decisions=0)
    per_layer, ran = [], set()
    heatmap = np.zeros((max((a["layer"] for a in layers), default=-1) + 1, surrogate.config.output_dim))
    for artifact in layers:
        layer = artifact["layer"]
        texts = [t[layer] for t in hidden.texts if layer in t]
        ref_keeps, ref_scores = [], []
        with torch.no_grad():
            for x in texts:
                scores = reference.score(layer, x.to(device.torch_device, torch_dtype))  # native dtype on the device
                lengths = torch.tensor([x.shape[0]], dtype=torch.int32, device=scores.device)
                ref_keeps.append(threshold_compaction(scores.T[None], lengths, tau, window, sink).keep[0].cpu())
                ref_scores.append(scores.float().cpu())
        row = {"layer": layer, "flips": 0, "unexplained": 0}
        for runner in exported_runners(bundle, manifest, artifact, backends, device, plugin_libraries):
            ran.add(runner.backend)
            with runner:
                for x, ref_keep, ref in zip(texts, ref_keeps, ref_scores):
                    got = torch.from_numpy(runner.infer({"hidden_states": x.to(torch_dtype).float().numpy().astype(feed_dtype)})["scores"]
                                           .astype(np.float32))
                    lengths = torch.tensor([x.shape[0]], dtype=torch.int32)
                    # Decisions are taken in the graph dtype, as kvpress compares in the model dtype.
                    got_keep = threshold_compaction(got.to(torch_dtype).T[None], lengths, tau, window, sink).keep[0]
                    diff = ref_keep != got_keep
                    near = (ref.T - tau).abs() <= tol
                    evictable = max(x.shape[0] - window, 0) * ref_keep.shape[0]
                    counts["decisions"] += diff.numel()
                    counts["outside_window"] += evictable
                    counts["flips"] += int(diff.sum())
                    counts["explained"] += int((diff & near).sum())
                    counts["unexplained"] += int((diff & ~near).sum())
                    row["flips"] += int(diff.sum())
                    row["unexplained"] += int((diff & ~near).sum())
        kept = sum(int(k.sum()) for k in ref_keeps)
        total = sum(k.numel() for k in ref_keeps)
        counts["kept"] += kept
        counts["reference_decisions"] += total
        heatmap[layer] = 1.0 - torch.cat(ref_keeps, dim=1).float().mean(dim=1).numpy()
        row["pruned_fraction"] = 1.0 - kept / max(total, 1)
        per_layer.append(row)
        if on_step:
            on_step()
    if not ran:
        return skipped("decision:keep_masks", "decision", "no requested backend can run the surrogate graphs here "
                       "(trt: no engines built from them)"), {}
    budget = int(FLIP_BUDGET * counts["outside_window"])
    failed = counts["unexplained"] > 0 or counts["explained"] > budget
    detail = {"threshold": tau, "window": window, "tolerance": tol, "dtype": dtype, "backend": ", ".join(sorted(ran)),
              "hidden_states": hidden.source, "hidden_states_how": hidden.description, "sequences": len(hidden.texts),
              "tokens": hidden.tokens(), "decisions": counts["decisions"], "decisions_outside_window": counts["outside_window"],
              "flips": counts["flips"], "explained_flips": counts["explained"], "unexplained_flips": counts["unexplained"],
              "explained_flip_budget": budget, "flip_budget_fraction": FLIP_BUDGET,
              "pruned_fraction": 1.0 - counts["kept"] / max(counts["reference_decisions"], 1),
              "reference_device": device.torch_device, "layers": per_layer}
    return Check("decision:keep_masks", "decision", "failed" if failed else "passed", detail), {"heatmap": heatmap}
