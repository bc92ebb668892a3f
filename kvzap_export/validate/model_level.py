"""Model-level parity: the real model generating with a KV cache that the *exported artifacts* compact
physically, per head, vs kvpress's ``DMSPress`` masking of the same model.

Prefill is dense (as kvpress; for a prompt that begins a text the decision level's hidden states were
captured from, our run takes that capture's forward, cut to the prompt: see ``hidden.captured_prefix``).
Then, per layer, the surrogate ONNX scores the prompt's hidden states, the ONNX ``threshold_compaction``
graph decides, and the ONNX ``kv_compaction`` graph moves each head's kept K/V to the front; the cache then
holds exactly each head's kept entries (``RaggedHeadsLayer``: ragged layout, bytes measured from its
tensors), and an attention function masks the padding of the per-call dense view. Generated tokens are
appended to every head; RoPE positions stay the original (logical) ones. Prompts of equal length run as one
batch (no padding), in our run and in kvpress's alike: a decode step streams the weights once for the batch.
Mode: prefill compaction (kvpress ``decoding=False``); decode-phase decisions are checked at decision level
(tests/test_kvpress_decision_parity.py).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

ATTN_NAME = "kvzap_compacted"
_LAYERS: dict[int, object] = {}  # layer -> its RaggedHeadsLayer (``valid``: bool (batch, kv_heads, width) of real slots)


def _attention(module, query, key, value, attention_mask, dropout=0.0, **kwargs):
    """SDPA where each KV head sees only its own kept slots (and everything appended since).

    ``dropout`` is positional because kvpress, once imported, wraps every registered attention
    function and calls it as ``func(module, query, key, value, attention_mask, dropout, **kwargs)``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layer = _LAYERS.get(module.layer_idx)
    if layer is None or query.shape[-2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, **kwargs)
    groups = query.shape[1] // layer.valid.shape[1]
    mask = layer.valid.repeat_interleave(groups, dim=1)[:, :, None, :]  # query heads of each KV group
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=kwargs.get("scaling"),
                                                           enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def compacted_attention(llm) -> Iterator[None]:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTN_NAME, _attention)
    AttentionMaskInterface.register(ATTN_NAME, eager_mask)
    previous = llm.config._attn_implementation
    llm.set_attn_implementation(ATTN_NAME)
    try:
        yield
    finally:
        _LAYERS.clear()
        llm.set_attn_implementation(previous)


def _sessions(bundle: Path, manifest: dict) -> tuple[dict[int, object], object, object]:
    from kvzap_export.runners.onnxrt_runner import OnnxrtRunner

    layers, compaction, kv = {}, None, None
    for art in manifest["artifacts"]:
        # One intra-op thread: these graphs are small, and ORT's pool would wait on the cores torch uses.
        if art["kind"] == "surrogate_layer":
            layers[art["layer"]] = OnnxrtRunner(bundle / art["path"], threads=1)
        elif art["kind"] == "threshold_compaction":
            compaction = OnnxrtRunner(bundle / art["path"], threads=1)
        elif art["kind"] == "kv_compaction":
            kv = OnnxrtRunner(bundle / art["path"], threads=1)
    return layers, compaction, kv


def _compact_cache(cache, hidden: dict[int, torch.Tensor], runners, manifest: dict) -> tuple[list[np.ndarray], int]:
    """Scores, decides and moves K/V of every layer with the ONNX artifacts; returns per-layer counts (B, H_kv).

    Every sequence of the batch has the prompt's length (no padding): the surrogate graph scores all their tokens
    in one call, the compaction graphs take the batch as it is.
    """
    from kvzap_export.validate.ragged_cache import RaggedHeadsLayer

    layers, compaction, kv = runners
    pruning = manifest["pruning"]
    counts_all, prompt_len = [], 0
    for layer_idx, runner in sorted(layers.items()):
        states = hidden[layer_idx].float()  # (B, T, hidden)
        batch, prompt_len = states.shape[:2]
        scores = runner.infer({"hidden_states": states.reshape(batch * prompt_len, -1).numpy()})["scores"]  # (B*T, H_kv)
        scores = scores.reshape(batch, prompt_len, -1).transpose(0, 2, 1)
        out = compaction.infer({"scores": np.ascontiguousarray(scores), "lengths": np.full(batch, prompt_len, np.int32),
                                "threshold": np.array(pruning["threshold"], np.float32),
                                "window": np.array(pruning["window"], np.int32)})
        layer = cache.layers[layer_idx]
        moved = kv.infer({"keys": layer.keys.float().numpy(), "values": layer.values.float().numpy(), "indices": out["indices"]})
        counts = out["counts"]
        dtype = layer.keys.dtype
        ragged = RaggedHeadsLayer.from_compacted(torch.from_numpy(moved["keys_out"]).to(dtype),
                                                 torch.from_numpy(moved["values_out"]).to(dtype), counts)
        cache.layers[layer_idx] = _LAYERS[layer_idx] = ragged  # the dense prompt cache of this layer is freed
        counts_all.append(counts)
    return counts_all, prompt_len


class Generation(NamedTuple):
    tokens: torch.Tensor  # (B, new_tokens)
    logits: torch.Tensor  # (B, new_tokens, vocab)
    counts: list[np.ndarray]  # per layer: kept entries per sequence and KV head after the prompt, (B, H_kv)
    prompt_len: int
    held_bytes: list[int]  # per sequence: K/V bytes the compacted cache holds after the prompt, measured from its tensors
    full_bytes: list[int]  # per sequence: K/V bytes of the dense prompt cache, measured from its tensors before compaction
    prefill_reused: int = 0  # sequences whose prefill an earlier forward computed (``generate_compacted``'s ``prefilled``)


@contextlib.contextmanager
def artifact_sessions(bundle: Path, manifest: dict) -> Iterator[tuple]:
    """The bundle's surrogate / compaction / kv_compaction graphs, open in ONNX Runtime."""
    runners = _sessions(bundle, manifest)
    every = [*runners[0].values(), runners[1], runners[2]]
    try:
        for runner in every:
            runner.activate()
        yield runners
    finally:
        for runner in every:
            runner.deactivate()


def generate_compacted(llm, ids: torch.Tensor, bundle: Path, manifest: dict, new_tokens: int, runners=None,
                       on_token=None, stop=None, prefilled=None) -> Generation:
    """Greedy generation with the physically compacted cache for a batch of equal-length prompts ``ids`` (B, T)
    (``runners`` from ``artifact_sessions``, or opened here; ``on_token()`` after each forward; ``stop``: a
    ``side_by_side`` job's event, checked before every decoder layer; ``prefilled(ids_row)``: what an earlier forward
    of this model computed for a prompt (``hidden.captured_prefix``), or None to prefill that prompt here)."""
    if runners is None:
        with artifact_sessions(bundle, manifest) as opened:
            return generate_compacted(llm, ids, bundle, manifest, new_tokens, opened, on_token, stop, prefilled)
    from kvzap_export.llm import decoder_layers
    from kvzap_export.threads import stop_hooks

    step = on_token or (lambda: None)
    with stop_hooks(decoder_layers(llm), stop):
        return _generate_compacted(llm, ids, runners, manifest, new_tokens, step, prefilled)


def _prefill(llm, ids: torch.Tensor, prefilled) -> tuple[object, dict[int, torch.Tensor], torch.Tensor, int]:
    """The dense prefill of ``ids`` (B, T): the KV cache, each layer's attention input (B, T, hidden), the last
    position's logits (B, vocab), and how many prompts came from ``prefilled`` instead of a forward here."""
    from transformers import DynamicCache

    from kvzap_export.llm import capture_hidden_states
    from kvzap_export.threads import prefill_threads
    from kvzap_export.validate.hidden import CapturedText

    rows = [prefilled(row) if prefilled is not None else None for row in ids]  # per prompt: a CapturedText or None
    fresh = [b for b, text in enumerate(rows) if text is None]
    logits: list[torch.Tensor | None] = [None] * len(rows)
    if fresh:
        computed = DynamicCache()
        with torch.no_grad(), capture_hidden_states(llm) as hidden, prefill_threads(llm):
            out = llm(input_ids=ids[fresh], past_key_values=computed, use_cache=True, logits_to_keep=1)
            states = {k: v.clone() for k, v in hidden.items()}
        if len(fresh) == len(rows):
            return computed, states, out.logits[:, -1], 0
        for i, b in enumerate(fresh):
            rows[b] = CapturedText(ids[b], {layer: s[i] for layer, s in states.items()},
                                   tuple(layer.keys[i] for layer in computed.layers),
                                   tuple(layer.values[i] for layer in computed.layers), None)
            logits[b] = out.logits[i, -1]
    with torch.no_grad():  # a reused prompt's logits: the LM head on its final norm output, as the model's forward does
        logits = [lm if lm is not None else llm.lm_head(text.final[-1:])[0] for lm, text in zip(logits, rows)]
    cache = DynamicCache()
    for layer in range(len(rows[0].keys)):
        cache.update(torch.stack([r.keys[layer] for r in rows]), torch.stack([r.values[layer] for r in rows]), layer)
    hidden = {layer: torch.stack([r.states[layer] for r in rows]) for layer in rows[0].states}
    return cache, hidden, torch.stack(logits), len(rows) - len(fresh)


def _generate_compacted(llm, ids, runners, manifest, new_tokens, step, prefilled) -> Generation:
    from kvzap_export.threads import prefill_threads

    cache, prompt_hidden, last, reused = _prefill(llm, ids, prefilled)
    step()
    logits = [last]
    full = [sum(t[b].numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
            for b in range(ids.shape[0])]
    with compacted_attention(llm), torch.no_grad(), prefill_threads(llm):
        counts, prompt_len = _compact_cache(cache, prompt_hidden, runners, manifest)
        held = [sum(layer.held_bytes(b) for layer in cache.layers) for b in range(ids.shape[0])]
        token = logits[-1].argmax(-1, keepdim=True)
        tokens = [token]
        for number in range(new_tokens - 1):
            position = torch.full((ids.shape[0], 1), prompt_len + number)
            out = llm(input_ids=token, past_key_values=cache, position_ids=position, cache_position=position[0], use_cache=True)
            step()
            logits.append(out.logits[:, -1])
            token = logits[-1].argmax(-1, keepdim=True)
            tokens.append(token)
    return Generation(torch.cat(tokens, 1), torch.stack(logits, 1), counts, prompt_len, held, full, reused)


def generate_kvpress(llm, ids: torch.Tensor, bundle: Path, manifest: dict, new_tokens: int, decoding: bool = False,
                     on_token=None, stop=None, press=None):
    """kvpress's masked run on the same prompts: DMSPress(KVzapPress) with the bundle's surrogate copy (a KvpressRun;
    ``press``: see ``reference.generate_kvpress``)."""
    from kvzap_export.llm import decoder_layers
    from kvzap_export.threads import stop_hooks
    from kvzap_export.validate.reference import generate_kvpress as run

    with stop_hooks(decoder_layers(llm), stop):
        return run(llm, ids, bundle, manifest, new_tokens, decoding, on_token, press)


def model_copies(llm, count: int) -> list:
    """``count`` copies of ``llm``'s module tree that share its parameters (inference never writes them), so the
    weights are held once. Hooks, attention implementation, config and buffers are per copy: some models write a
    buffer during a forward (a dynamic RoPE's ``inv_freq``)."""
    shared = {id(t): t for t in llm.parameters()}
    return [copy.deepcopy(llm, dict(shared)) for _ in range(count)]


def room_for_runs_beside(llm, count: int) -> bool:
    """True when ``count`` more runs can go beside the first: each holds its own KV cache, logits and activations,
    estimated here at the size of ``llm``'s weights per run (at the model level's settings, for SmolLM2, about 0.3 GB
    of cache, logits and captured states by their shapes, beside 0.5 GB of float32 weights; a small model with a large
    vocabulary would need more for its logits), all of them within half the memory this process
    can still get (``resources.available_memory``: the host's MemAvailable, capped by a container's cgroup limit). The
    embedded 135M model yes, an 8B model on a 64 GB machine no."""
    from kvzap_export.resources import available_memory

    size = sum(t.numel() * t.element_size() for t in (*llm.parameters(), *llm.buffers()))
    available = available_memory()
    if available is None:
        return False  # unknown: runs one after the other
    return count * size <= available // 2


def held_out_prompts(tokenizer, count: int, tokens: int) -> list[torch.Tensor]:
    from kvzap_export.texts import held_out_texts

    return [tokenizer(text, return_tensors="pt").input_ids[:, :tokens] for text in held_out_texts(count)]


def run_model_level(bundle: Path, manifest: dict, model: str, prompts: int = 5, new_tokens: int = 64,
                    prompt_tokens: int = 400, logits_atol: float = 1e-3, progress=None) -> dict:
    """Compares greedy continuations and logits with kvpress, and the K/V bytes the compacted cache held
    (measured from its tensors) with the dense cache's (measured) minus the entries kvpress masked."""
    from kvzap_export.llm import equal_length_batches, load_llm
    from kvzap_export.ops import memory_report
    from kvzap_export.threads import side_by_side, usable_cores
    from kvzap_export.validate import reference as ref
    from kvzap_export.validate.hidden import captured_prefix

    if manifest["dtype"] != "float32":
        return {"status": "skipped", "reason": "the model-level check runs the fp32 artifacts in ONNX Runtime; "
                                               f"this bundle is {manifest['dtype']}"}
    llm, tokenizer = load_llm(model, dtype="float32")
    prompt_ids = held_out_prompts(tokenizer, prompts, prompt_tokens)
    batches = equal_length_batches([ids.shape[1] for ids in prompt_ids])
    # Three greedy runs of each batch (ours, kvpress prefill-only, kvpress decoding=True, stored as the reference),
    # each a forward per new token: the bar advances per forward, so a slow machine still shows it moving.
    advance = progress(f"model level: {prompts} prompts × (compacted run, kvpress ×2), {new_tokens} tokens each, "
                       f"{len(batches)} batch{'es' if len(batches) > 1 else ''}", 3 * new_tokens * len(batches)) \
        if progress else None
    runs: dict[int, tuple] = {}
    reused = 0
    reference = ref.new_reference(manifest, model, "float32", new_tokens)  # kvpress's tokens, for engines to compare with
    # The three runs of a batch go side by side (kvzap_export.threads.side_by_side), each on its own copy of the model
    # (kvpress's press hooks and our attention implementation are per model object; the copies share the weights); one
    # after the other on one model where two more runs would not fit comfortably in memory, or on one core.
    together = usable_cores() > 1 and room_for_runs_beside(llm, 2)
    reuse = functools.partial(captured_prefix, model)  # our run's prefill from the capture (module docstring)
    models = [llm, *model_copies(llm, 2)] if together else [llm] * 3
    with artifact_sessions(bundle, manifest) as runners:
        for batch in batches:
            ids = torch.cat([prompt_ids[i] for i in batch])
            # kvpress's presses are made here, in this thread: loading their surrogate is not thread-safe.
            presses = [ref.kvpress_press(bundle, manifest, models[1 + d], decoding=d) for d in (False, True)]
            jobs = [lambda stop: generate_compacted(models[0], ids, bundle, manifest, new_tokens, runners, advance, stop,
                                                    reuse),
                    lambda stop: generate_kvpress(models[1], ids, bundle, manifest, new_tokens, False, advance, stop, presses[0]),
                    lambda stop: generate_kvpress(models[2], ids, bundle, manifest, new_tokens, True, advance, stop, presses[1])]
            ours, theirs, decoding = side_by_side(jobs, together)
            for row, index in enumerate(batch):
                runs[index] = (ours, theirs, decoding, row)
            reused += ours.prefill_reused
    del models  # the copies' modules are freed here (their weights are llm's)
    per_prompt, worst_logits, all_counts, lengths = [], 0.0, [], []
    held_total = full_total = masked_total = 0
    for number, ids in enumerate(prompt_ids):
        ours, theirs, decoding, row = runs[number]
        ref.add_prompt(reference, f"held-out text {number + 1} of {prompts} (first {prompt_tokens} tokens)", ids,
                       {False: theirs.tokens[row:row + 1], True: decoding.tokens[row:row + 1]})
        mine, their_tokens = ours.tokens[row], theirs.tokens[row]
        same = bool(torch.equal(mine, their_tokens))
        # Compare logits while both runs saw the same tokens (all steps if the continuations agree).
        steps = new_tokens if same else int((mine != their_tokens).int().argmax()) + 1
        diff = float((ours.logits[row, :steps] - theirs.logits[row, :steps]).abs().max())
        worst_logits = max(worst_logits, diff)
        counts = np.stack([layer[row] for layer in ours.counts])
        entries = counts.size * ours.prompt_len
        per_prompt.append({"prompt_tokens": ours.prompt_len, "identical_tokens": same, "max_logits_diff": diff,
                           "pruned_fraction": 1.0 - int(counts.sum()) / entries, "kvpress_masked_fraction": theirs.masked[row] / entries,
                           "held_bytes": ours.held_bytes[row], "full_bytes": ours.full_bytes[row]})
        all_counts.append(counts)
        lengths.append(ours.prompt_len)
        held_total += ours.held_bytes[row]
        full_total += ours.full_bytes[row]
        masked_total += theirs.masked[row]
    # Bytes each engine layout would hold, computed from the compaction's counts (float32, as this run).
    per_entry = 2 * manifest["model"]["head_dim"] * 4
    reports = [memory_report(torch.from_numpy(c)[:, None, :], torch.tensor([n])) for c, n in zip(all_counts, lengths)]
    full_entries = sum(r["full_entries"] for r in reports)
    layouts = {name: {"bytes": int(sum(r[f"{name}_entries"] for r in reports) * per_entry),
                      "freed_fraction": 1.0 - sum(r[f"{name}_entries"] for r in reports) / full_entries}
               for name in ("ragged", "per_layer_padded", "uniform")}
    pruned = 1.0 - sum(r["ragged_entries"] for r in reports) / full_entries
    identical = all(p["identical_tokens"] for p in per_prompt)
    # Two independent measurements meet here: the bytes our compacted cache's tensors held, and the dense cache's
    # bytes (its tensors, before compaction) less the entries kvpress's own run masked on the same prompts.
    entry_bytes = full_total // max(full_entries, 1)  # one (layer, head, position)'s K and V, from the measured cache
    expected_held = full_total - masked_total * entry_bytes
    bytes_ok = held_total == expected_held and masked_total > 0
    passed = identical and worst_logits <= logits_atol and bytes_ok
    ref.write_reference(bundle, reference)
    held_fraction = held_total / max(full_total, 1)
    return {"status": "passed" if passed else "failed", "mode": "prefill compaction (kvpress decoding=False)",
            "prompts": per_prompt, "new_tokens": new_tokens, "identical_continuations": sum(p["identical_tokens"] for p in per_prompt),
            "max_logits_diff": worst_logits, "logits_atol": logits_atol, "pruned_fraction": pruned,
            "kvpress_masked_fraction": masked_total / max(full_entries, 1),
            "measured_held_bytes": held_total, "measured_full_bytes": full_total, "expected_held_bytes": expected_held,
            "bytes_comparison": "held bytes measured from the compacted cache's tensors vs the dense cache's bytes measured "
                                "before compaction less the entries kvpress masked (kvpress's own decisions)",
            "kv_cache_layouts_from_counts": layouts, "physical_layout_held": "ragged (per-head tensors, RaggedHeadsLayer)",
            "reference": str(ref.PATH),
            "prefill_from_capture": f"{reused} of {prompts} prompts: our run's prefill is the hidden-state capture's forward "
                                    "cut to the prompt (attention is causal); kvpress's runs prefill themselves",
            "summary": f"{sum(p['identical_tokens'] for p in per_prompt)}/{len(per_prompt)} identical {new_tokens}-token continuations, "
                       f"max logits diff {worst_logits:.1e}, pruned {pruned:.1%} (kvpress masked {masked_total / max(full_entries, 1):.1%}); "
                       f"K/V bytes held {held_fraction:.1%} of the full cache (both measured"
                       f"{'' if bytes_ok else f'; expected {expected_held / max(full_total, 1):.1%} from kvpress’s masks'}); "
                       f"layouts from counts: per-layer padded {1 - layouts['per_layer_padded']['freed_fraction']:.1%}, "
                       f"uniform {1 - layouts['uniform']['freed_fraction']:.1%} of full"}
