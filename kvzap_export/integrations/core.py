"""Engine-independent KVzap state for serving engines (pure torch; CPU-testable).

An engine keeps, per request, the KV entries it physically holds. ``RequestState`` mirrors them: for every
layer and KV head, the *logical* position (RoPE position, index in the original sequence) and the stored
surrogate score of each physically kept entry, in physical order (ascending positions). Its transitions:

- ``prefill(scores, last=...)``: one-shot or chunked prefill. Each chunk is appended, then every entry
  that has left the window is tested once (strict ``score < threshold``; kvpress ``DMSPress``). The kept
  sets after the last chunk equal those of a one-shot prefill (tested below on random data and SmolLM2).
- ``decode(scores)``: new tokens appended; with ``decoding=True`` (kvpress ``decoding=True``) entries that
  leave the window are tested, else nothing is evicted after the prefill (kvpress ``decoding=False``).

Each transition returns a ``Decision``: per (layer, head), the physical source indices of the entries to
keep, in order. The engine moves its K/V accordingly (kept entries to the front), exactly as the state
moved its positions and scores. The rule itself runs through ``kvzap_export.kernels.torch_ops``
(``threshold_compaction``: the PyTorch reference on CPU, the Triton kernel on CUDA), one row per
(layer, head) with its physical length: re-applying the rule to the compacted cache is kvpress's
"each token tested once when it leaves the window" (DESIGN.md).

Layouts (``KVzapPolicy.layout``):

- ``"ragged"``: each head keeps exactly kvpress's set (per-head physical lengths): masking backends,
  varlen attention, the per-head cache of ``validate/model_level.py``.
- ``"uniform"``: TensorRT-LLM and SGLang hold one KV length per request for every head and layer, so each
  (layer, head) keeps its own set plus its best-scored evicted entries up to ``K`` = the request's
  maximum count (``ops.formats.uniform_selection``; ``count=`` overrides ``K``, e.g. agreed across
  tensor-parallel ranks). The rule's own set (``rule_kept``) is still tracked, so a backend may mask the
  extras for exact kvpress semantics on uniform storage.

Logical positions are preserved: ``logical_length`` keeps counting every token fed, the next token's RoPE
position is ``logical_length``, and ``num_compressed_tokens = logical_length - physical_length`` is what
an engine subtracts from its cached length (TensorRT-LLM ``py_num_compressed_tokens``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvzap_export.errors import ConfigError, InputError
from kvzap_export.ops.compaction import MAX_WINDOW, keep_mask
from kvzap_export.ops.formats import UniformSelection, trtllm_sparse_layout, uniform_selection

LAYOUTS = ("ragged", "uniform")


# Spare columns a RequestState's buffers take when they grow: doubling, but never more than this many at once
# (the buffers live beside the engine's KV, outside its budget: at 64k tokens doubling would hold twice the need).
GROW_AHEAD = 4096


@dataclass(frozen=True)
class KVzapPolicy:
    """Pruning settings shared by every request (the bundle's ``pruning`` section plus the serving mode).

    threshold: τ, log-score below which an entry leaving the window is evicted (strict ``<``).
    window: most recent tokens always kept. sink: first tokens always kept (our extension; kvpress: 0).
    decoding: also evict during decoding (kvpress ``decoding=True``); False = prefill only.
    layout: "uniform" (one physical length per request: TRT-LLM, SGLang) or "ragged" (per head).
    """

    threshold: float
    window: int = 128
    sink: int = 0
    decoding: bool = True
    layout: str = "uniform"

    def __post_init__(self):
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or math.isnan(self.threshold):
            raise ConfigError(f"threshold must be a finite number such as -4, got {self.threshold!r}")
        for name in ("window", "sink"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_WINDOW:
                raise ConfigError(f"{name} must be an integer in [0, {MAX_WINDOW}], got {value!r}")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"layout {self.layout!r} is not supported; use one of {list(LAYOUTS)}")

    @classmethod
    def from_manifest(cls, manifest: dict, **overrides) -> "KVzapPolicy":
        """The bundle's ``pruning`` section (threshold, window, sink), with serving options added."""
        pruning = manifest.get("pruning") or {}
        values = {k: pruning[k] for k in ("threshold", "window", "sink") if k in pruning}
        values.update(overrides)
        if "threshold" not in values:
            raise ConfigError("manifest has no pruning.threshold; re-export the bundle or pass threshold=")
        return cls(**values)


class Proposal(NamedTuple):
    """The rule's verdict on the current physical entries, before the engine commits a count.

    keep: bool [L, H, P] (kvpress's kept set among the physical entries); local_count: the uniform count
    this rank needs (max kept over layers and heads); 0 in the ragged layout is never used.
    """

    keep: torch.Tensor
    local_count: int


class Decision(NamedTuple):
    """What the engine must do to its K/V after a transition.

    indices: int64 [L, H, K] physical source indices (into the rows *before* this decision, new tokens
    included), ascending, -1 after each row's count (when nothing is freed, possibly a broadcast view: call
    ``.contiguous()`` before handing it to a kernel that assumes strides); the engine moves entry ``indices[l, h, j]`` to
    physical slot ``j``. counts: int64 [L, H] entries kept per row (all equal in the uniform layout).
    physical_before: int64 [L, H] row lengths before the decision. freed: entries removed (all rows).
    """

    indices: torch.Tensor
    counts: torch.Tensor
    physical_before: torch.Tensor
    freed: int

    @property
    def uniform_count(self) -> int:
        """The request's shared physical length after the decision (uniform layout)."""
        return int(self.counts.max()) if self.counts.numel() else 0


def _stack_scores(scores, num_layers: int, num_kv_heads: int) -> torch.Tensor:
    """Accepts [L, H, n] or a list of L tensors [n, H] (the surrogate's per-layer output)."""
    if isinstance(scores, (list, tuple)):
        if len(scores) != num_layers:
            raise InputError(f"expected {num_layers} layers of scores, got {len(scores)}")
        scores = torch.stack([s.transpose(0, 1) if s.dim() == 2 else s for s in scores])
    if not isinstance(scores, torch.Tensor) or scores.dim() != 3 or scores.shape[:2] != (num_layers, num_kv_heads):
        shape = list(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise InputError(f"scores must be [layers={num_layers}, kv_heads={num_kv_heads}, new_tokens], got {shape}")
    if not scores.is_floating_point():
        raise InputError(f"scores must be floating point, got {scores.dtype}")
    return scores


class RequestState:
    """One request's KVzap state: what the engine physically holds, per layer and KV head.

    positions: int64 [L, H, P] logical positions (ascending per row, -1 padding);
    scores: [L, H, P] stored surrogate scores (model dtype, as kvpress compares in it);
    counts: int64 [L, H] physical entries per row; rule_kept: bool [L, H, P] entries kvpress keeps
    (False for the uniform layout's extras and for padding).
    """

    def __init__(self, policy: KVzapPolicy, num_layers: int, num_kv_heads: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        if num_layers <= 0 or num_kv_heads <= 0:
            raise ConfigError(f"num_layers and num_kv_heads must be positive, got {num_layers}, {num_kv_heads}")
        self.policy = policy
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.positions = torch.empty(num_layers, num_kv_heads, 0, dtype=torch.int64, device=device)
        self.scores = torch.empty(num_layers, num_kv_heads, 0, dtype=dtype, device=device)
        self.rule_kept = torch.empty(num_layers, num_kv_heads, 0, dtype=torch.bool, device=device)
        self.counts = torch.zeros(num_layers, num_kv_heads, dtype=torch.int64, device=device)
        self.logical_length = 0
        self.prompt_length: int | None = None  # set when the last prefill chunk arrives

    # ---- lengths -------------------------------------------------------------------------------
    @property
    def phase(self) -> str:
        return "prefill" if self.prompt_length is None else "decode"

    @property
    def physical_length(self) -> int:
        """The longest row (in the uniform layout: the request's one physical KV length)."""
        return int(self.counts.max()) if self.counts.numel() else 0

    @property
    def num_compressed_tokens(self) -> int:
        """Logical minus physical length: what an engine subtracts from its cached length."""
        return self.logical_length - self.physical_length

    # ---- transitions -----------------------------------------------------------------------------
    def prefill(self, scores, last: bool = True, count: int | None = None) -> Decision:
        """Appends one prefill chunk (or the whole prompt) and decides. scores: [L, H, n] or L x [n, H]."""
        return self.commit(self.feed(scores, prefill=True, last=last), count)

    def decode(self, scores, count: int | None = None) -> Decision:
        """Appends generated tokens (usually one) and decides. scores: [L, H, n] or L x [n, H]."""
        return self.commit(self.feed(scores, prefill=False), count)

    def feed(self, scores, prefill: bool, last: bool = True) -> Proposal:
        """Appends and proposes, leaving ``commit`` to the caller (to agree on a count across ranks first).

        An engine that must not compact between prefill chunks calls ``append`` for the earlier chunks and
        ``feed(..., last=True)`` for the last one: the decisions equal a one-shot prefill either way.
        """
        if prefill and self.phase != "prefill":
            raise InputError(f"prefill after the prompt ended (logical length {self.logical_length}); call decode()")
        if not prefill and self.phase != "decode":
            raise InputError("decode before the last prefill chunk; pass last=True to the final prefill()")
        self.append(scores)
        proposal = self.propose()  # still in the prefill phase: the last chunk's entries are tested too
        if prefill and last:
            self.prompt_length = self.logical_length
        return proposal

    def append(self, scores) -> None:
        """Adds new tokens at logical positions ``logical_length ...`` to the end of every row (no decision)."""
        new = _stack_scores(scores, self.num_layers, self.num_kv_heads).to(self.scores.device)
        n = new.shape[-1]
        if n == 0:
            return
        if self.scores.shape[-1] == 0:
            self.scores = self.scores.to(new.dtype)
        elif new.dtype != self.scores.dtype:
            raise InputError(f"scores changed dtype from {self.scores.dtype} to {new.dtype} within a request")
        width = int(self.counts.max()) + n
        grow = width - self.positions.shape[-1]
        if grow > 0:  # room for this append and as many more, up to GROW_AHEAD (a decode step appends one: no
            grow = max(grow, min(self.positions.shape[-1], GROW_AHEAD))  # copy every step, no doubling at 64k tokens)
            L, H = self.num_layers, self.num_kv_heads
            self.positions = torch.cat([self.positions, self.positions.new_full((L, H, grow), -1)], -1)
            self.scores = torch.cat([self.scores, self.scores.new_zeros((L, H, grow))], -1)
            self.rule_kept = torch.cat([self.rule_kept, self.rule_kept.new_zeros((L, H, grow))], -1)
        slot = self.counts[..., None] + torch.arange(n, device=self.counts.device)  # [L, H, n]
        logical = torch.arange(self.logical_length, self.logical_length + n, device=self.counts.device)
        self.positions.scatter_(-1, slot, logical.expand_as(slot).contiguous())
        self.scores.scatter_(-1, slot, new)
        self.rule_kept.scatter_(-1, slot, torch.ones_like(slot, dtype=torch.bool))
        self.counts += n
        self.logical_length += n

    def propose(self) -> Proposal:
        """The rule on the current rows; in prefill-only mode after the prompt, nothing is tested."""
        from kvzap_export.kernels.torch_ops import threshold_compaction

        L, H, P = self.scores.shape
        if self.phase == "decode" and not self.policy.decoding:
            # Prefill only (kvpress decoding=False): nothing is tested after the prompt; the rule's set is
            # what it was at the end of the prompt plus every generated token.
            keep = (torch.arange(P, device=self.counts.device) < self.counts[..., None]) & self.rule_kept
        elif P == 0:
            keep = torch.zeros(L, H, 0, dtype=torch.bool, device=self.counts.device)
        else:
            p = self.policy
            scores, lengths = self.scores.reshape(L * H, 1, P), self.counts.reshape(L * H)
            if scores.is_cuda:
                # Row lengths never exceed P by construction: not read back to validate them (no sync per step).
                keep = threshold_compaction(scores, lengths, p.threshold, p.window, p.sink, check_lengths=False).keep
            else:  # the op's own rule on the CPU, without the indices it would sort for (commit lays them out)
                keep = keep_mask(scores, lengths, float(p.threshold), p.window, p.sink)
            keep = keep.reshape(L, H, P)
            # A uniform extra (evicted earlier, held only as padding) never re-enters the rule's set.
            keep = keep & self.rule_kept
        local = int(keep.sum(-1).max()) if keep.numel() else 0
        return Proposal(keep, local)

    def commit(self, proposal: Proposal, count: int | None = None) -> Decision:
        """Applies a proposal: the state's rows become the kept entries; returns the engine's moves."""
        keep = proposal.keep
        L, H, P = keep.shape
        before = self.counts.clone()
        pos = torch.arange(P, device=keep.device)
        if self.policy.layout == "uniform":
            if P and bool((self.counts != self.counts[0, 0]).any()):
                raise InputError("uniform layout with unequal row lengths; every row of a request must hold the same count")
            held = int(self.counts[0, 0]) if P else 0
            if (count if count is not None else proposal.local_count) == held:
                # Some row keeps every entry: the shared length cannot shrink, nothing moves (no sort needed).
                indices = torch.arange(held, device=keep.device).expand(L, H, held)
                new_counts = self.counts.clone()
            else:
                length = torch.tensor([held], device=keep.device)
                counts = None if count is None else torch.tensor([count], device=keep.device)
                sel = uniform_selection(self.scores[:, None], keep[:, None], length, counts)
                indices = sel.indices[:, 0].to(torch.int64)  # [L, H, K]
                new_counts = torch.full((L, H), int(sel.counts[0]), dtype=torch.int64, device=keep.device)
        else:
            if count is not None:
                raise InputError("count= applies to the uniform layout only")
            new_counts = keep.sum(-1)
            k_max = int(new_counts.max()) if new_counts.numel() else 0
            # Kept entries in order: each one's rank among the kept is its new place (a scan, not a sort);
            # the others land in a spare column.
            rank = torch.where(keep, torch.cumsum(keep, -1) - 1, k_max)
            indices = torch.full((L, H, k_max + 1), -1, dtype=torch.int64, device=keep.device)
            indices.scatter_(-1, rank, pos.expand(L, H, P))
            indices = indices[..., :k_max]
        freed = int((before - new_counts).sum())
        if freed == 0:  # every row keeps every entry, in place: only the rule's verdicts change
            self.rule_kept = keep & (pos < new_counts[..., None])
            return Decision(indices, new_counts.clone(), before, 0)
        valid = indices >= 0
        gather = indices.clamp(min=0)
        k = indices.shape[-1]
        # Into the same buffers (their width is the room appends grow into), kept entries first, padding after.
        positions = torch.where(valid, self.positions.gather(-1, gather), -1)
        scores = torch.where(valid, self.scores.gather(-1, gather), torch.zeros((), dtype=self.scores.dtype,
                                                                                  device=keep.device))
        rule_kept = valid & keep.gather(-1, gather)
        self.positions[..., :k], self.positions[..., k:] = positions, -1
        self.scores[..., :k], self.scores[..., k:] = scores, 0
        self.rule_kept = torch.zeros_like(self.positions, dtype=torch.bool)
        self.rule_kept[..., :k] = rule_kept
        self.counts = new_counts
        return Decision(indices, new_counts.clone(), before, freed)

    # ---- views -----------------------------------------------------------------------------------
    def visible(self, layer: int, exact: bool = True) -> torch.Tensor:
        """bool [H, logical_length]: positions attention may see (exact: kvpress's set; else all stored)."""
        H, P = self.num_kv_heads, self.positions.shape[-1]
        out = torch.zeros(H, self.logical_length + 1, dtype=torch.bool, device=self.positions.device)
        held = torch.arange(P, device=self.positions.device) < self.counts[layer][:, None]
        if exact:
            held = held & self.rule_kept[layer]
        target = torch.where(held, self.positions[layer], self.logical_length)  # padding lands in a spare column
        out.scatter_(-1, target, torch.ones_like(target, dtype=torch.bool))
        return out[:, : self.logical_length]

    def visible_all(self, exact: bool = True) -> torch.Tensor:
        """bool [L, H, logical_length]: ``visible(layer)`` for every layer at once (one scatter)."""
        P = self.positions.shape[-1]
        out = torch.zeros(self.num_layers, self.num_kv_heads, self.logical_length + 1, dtype=torch.bool,
                          device=self.positions.device)
        held = torch.arange(P, device=self.positions.device) < self.counts[..., None]
        if exact:
            held = held & self.rule_kept
        target = torch.where(held, self.positions, self.logical_length)  # padding lands in a spare column
        out.scatter_(-1, target, torch.ones_like(target, dtype=torch.bool))
        return out[..., : self.logical_length]

    def kept_positions(self, layer: int, head: int, exact: bool = True) -> torch.Tensor:
        """int64 [n]: logical positions held by one (layer, head), ascending."""
        n = int(self.counts[layer, head])
        row = self.positions[layer, head, :n]
        return row[self.rule_kept[layer, head, :n]] if exact else row


# ---- batch views for engines ----------------------------------------------------------------------

def sparse_layout(selections: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """TensorRT-LLM's sparse KV layout for one layer from each request's selection rows.

    selections: per request, int [H, K_b] (a ``Decision.indices[layer]`` of the uniform layout, or a
    ``budget_selection`` row set); -1 padding is dropped. Returns (indices int32 [H, sum K_b] ascending
    per request segment, offsets int32 [num_requests + 1]), via ``ops.formats.trtllm_sparse_layout``.
    """
    if not selections:
        raise InputError("sparse_layout needs at least one request's selection")
    heads = selections[0].shape[0]
    counts = torch.tensor([int((s[0] >= 0).sum()) if s.numel() else 0 for s in selections], dtype=torch.int32)
    k_max = int(counts.max()) if counts.numel() else 0
    padded = torch.full((len(selections), heads, k_max), -1, dtype=torch.int32)
    for b, sel in enumerate(selections):
        if sel.shape[0] != heads or bool(((sel >= 0).sum(-1) != counts[b]).any()):
            raise InputError("every request's selection must keep the same count on every head (uniform layout)")
        padded[b, :, : int(counts[b])] = sel[:, : int(counts[b])].to(torch.int32).cpu()
    return trtllm_sparse_layout(UniformSelection(padded, counts))


def context_budget(prompt_length: int, keep_fraction: float, window: int, sink: int = 0) -> int:
    """A fixed per-request KV budget decided from the prompt length alone (TRT-LLM 1.2.x variant).

    ``ceil(keep_fraction * T)``, at least the protected window + sink, at most ``T``.
    """
    if not 0.0 < keep_fraction <= 1.0:
        raise ConfigError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
    return min(prompt_length, max(window + sink, math.ceil(keep_fraction * prompt_length)))


def budget_selection(scores: torch.Tensor, lengths: torch.Tensor, budgets: torch.Tensor, policy: KVzapPolicy) -> UniformSelection:
    """Exactly ``budgets[b]`` entries per (request, head): protected first, then kvpress's kept set by
    score, then the best-scored evicted ones; ascending positions, -1 after.

    When a head's kept set fits the budget (the usual case when the budget comes from the measured
    compression), the selection contains it exactly; otherwise its lowest-scored kept entries are
    dropped — the 1.2.x variant's stated deviation. scores: (batch, heads, seq); lengths, budgets: (batch,).
    """
    from kvzap_export.kernels.torch_ops import threshold_compaction

    keep = threshold_compaction(scores, lengths, policy.threshold, policy.window, policy.sink).keep
    seq = scores.shape[-1]
    pos = torch.arange(seq, device=scores.device)
    limit = lengths.to(scores.device, torch.int64)[:, None, None]
    valid = pos < limit
    protected = valid & ((pos >= limit - policy.window) | (pos < policy.sink))
    tier = torch.where(protected, 3, torch.where(keep, 2, torch.where(valid, 1, 0)))
    by_score = torch.sort(scores.float().nan_to_num(nan=torch.inf), dim=-1, descending=True, stable=True).indices
    order = by_score.gather(-1, torch.sort(tier.gather(-1, by_score), dim=-1, descending=True, stable=True).indices)
    budgets = torch.minimum(budgets.to(scores.device, torch.int64), lengths.to(scores.device, torch.int64))
    k_max = int(budgets.max()) if budgets.numel() else 0
    chosen = order[..., :k_max]
    chosen = torch.where(torch.arange(k_max, device=scores.device) < budgets[:, None, None], chosen, seq)
    chosen = torch.sort(chosen, dim=-1).values
    return UniformSelection(torch.where(chosen < seq, chosen, -1).to(torch.int32), budgets.to(torch.int32))
