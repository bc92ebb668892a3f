"""Decision parity with kvpress on a real model (SmolLM2-135M-Instruct, offline).

kvpress ``DMSPress(KVzapPress)`` masks KV entries of the real model; our pipeline (the bundle's
per-layer surrogate ONNX in ONNX Runtime, then the bundle's ONNX ``threshold_compaction`` graph) must
reproduce every layer's ``masked_key_indices``:

- prefill only (``decoding=False``): one compaction of the prompt;
- ``decoding=True`` over 64 greedy tokens: the engine's way (DESIGN.md), i.e. compaction of the
  prompt, then after every step the rule is re-applied to the already-compacted cache and its stored
  scores (each head's cache is one row of the graph's batch, with its own physical length).

Thresholds are the 30/50/70% quantiles of kvpress's own scores over the evictable prefix; kvpress's
measured compression (masked / (kv_heads x cache_len), mean over layers) must lie in [0.2, 0.8].
Hidden states and kvpress's scores are captured inside kvpress's run, so both sides decide on the
same inputs. Tolerance: a disagreement is *explained* only if kvpress's score lies within
``TOL = 1e-4 x max(1, |τ|)`` of τ (the test also checks that ORT's scores are within TOL of kvpress's);
the bar is zero unexplained flips.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow

WINDOW = 128
PROMPT_TOKENS = 600
NEW_TOKENS = 64
QUANTILES = (0.3, 0.5, 0.7)


def tolerance(threshold: float) -> float:
    return 1e-4 * max(1.0, abs(threshold))


@pytest.fixture(scope="module")
def reference_inputs(tmp_path_factory):
    """The test data every kvpress parity test shares: the model, a kvpress-format surrogate, the prompt."""
    from pydoc_data.topics import topics

    from kvzap_export.llm import load_llm
    from kvzap_export.presets import load_preset
    from tests.helpers import synthetic_checkpoint

    llm, tokenizer = load_llm("smollm2-135m")
    root = tmp_path_factory.mktemp("parity")
    # A kvpress-format surrogate with SmolLM2's shapes (random weights, fixed seed; scaled to spread the scores).
    weights = synthetic_checkpoint(load_preset("smollm2-135m"), "mlp", root / "weights", seed=7, scale=3.0)
    ids = tokenizer(topics["for"] + topics["while"] + topics["try"], return_tensors="pt").input_ids[:, :PROMPT_TOKENS]
    assert ids.shape[1] == PROMPT_TOKENS
    return llm, weights, ids


@pytest.fixture(scope="module")
def setup(reference_inputs):
    from kvzap_export.pipeline import ExportOptions, run_pipeline
    from kvzap_export.runners.onnxrt import ort_session

    llm, weights, ids = reference_inputs
    bundle = weights.parent / "bundle"
    manifest = run_pipeline(ExportOptions(model="smollm2-135m", out=bundle, weights=str(weights), check=False))
    layers = sorted((a for a in manifest["artifacts"] if a["kind"] == "surrogate_layer"), key=lambda a: a["layer"])
    compaction = next(a for a in manifest["artifacts"] if a["kind"] == "threshold_compaction")
    sessions = {"layers": [ort_session(bundle / a["path"]) for a in layers],
                "compaction": ort_session(bundle / compaction["path"])}
    return llm, bundle, sessions, ids


def kvpress_run(llm, checkpoint, ids, threshold, decoding):
    """kvpress's masked positions per layer, plus the hidden states and kvpress scores of every fed token.

    checkpoint: the kvpress-format surrogate directory (a bundle's ``surrogate/``).
    """
    from kvpress import DMSPress, KVzapPress
    from kvpress.presses.kvzap_press import KVzapModel

    from kvzap_export.llm import capture_hidden_states

    scorer = KVzapPress(model_type="mlp")
    scorer.kvzap_model = KVzapModel.from_pretrained(str(checkpoint))
    # The name post_init_from_model derives from the model: set, so kvpress does not try to download.
    scorer.kvzap_model_name = f"nvidia/KVzap-mlp-{llm.config.name_or_path.split('/')[-1]}"
    scores: dict[int, list[torch.Tensor]] = {}
    score_fn = scorer.score

    def recording_score(module, *args, **kwargs):
        out = score_fn(module, *args, **kwargs)
        scores.setdefault(module.layer_idx, []).append(out.detach().clone())
        return out

    scorer.score = recording_score  # DMSPress calls self.press.score
    press = DMSPress(press=scorer, threshold=threshold, sliding_window_size=WINDOW, decoding=decoding)
    with press(llm), capture_hidden_states(llm) as hidden, torch.no_grad():
        if decoding:
            out = llm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                               do_sample=False)
            assert out.shape[1] == ids.shape[1] + NEW_TOKENS
        else:
            llm(input_ids=ids, use_cache=True)
        hidden = {k: v.clone() for k, v in hidden.items()}
    masked = []
    for layer in llm.model.layers:
        idx = getattr(layer.self_attn, "masked_key_indices", None)
        masked.append(set() if idx is None else {(b, h, t) for b, h, t in zip(*(i.tolist() for i in idx))})
        layer.self_attn.masked_key_indices = None
    ref_scores = [torch.cat(scores[layer], dim=-1)[0].float().numpy() for layer in range(len(masked))]  # [H, T]
    return masked, hidden, ref_scores, press.compression_ratio


def compaction_feed(scores: np.ndarray, lengths, threshold: float) -> dict[str, np.ndarray]:
    """The graph's feed: scores [batch, kv_heads, seq], lengths [batch]."""
    return {"scores": np.ascontiguousarray(scores, np.float32), "lengths": np.asarray(lengths, np.int32),
            "threshold": np.array(threshold, np.float32), "window": np.array(WINDOW, np.int32)}


def per_head_rows(rows: list[np.ndarray], heads: int) -> np.ndarray:
    """One batch row per head's cache (padded to the longest), broadcast over the graph's fixed kv_heads axis."""
    out = np.zeros((len(rows), heads, max(len(r) for r in rows)), np.float32)
    for i, row in enumerate(rows):
        out[i, :, : len(row)] = row
    return out


def our_kept(sessions, hidden, threshold, prompt_len: int, decoding: bool):
    """Per layer: the (head, position) pairs our pipeline keeps, and our ORT scores [H, T]."""
    kept, all_scores = [], []
    compaction = sessions["compaction"]
    for layer, scorer in enumerate(sessions["layers"]):
        scores = scorer.run(["scores"], {"hidden_states": hidden[layer][0].numpy()})[0].T  # [H, T]
        heads, total = scores.shape
        all_scores.append(scores)
        # Prefill: the prompt in one compaction (batch 1, all heads).
        _, counts, indices = compaction.run(None, compaction_feed(scores[None, :, :prompt_len], [prompt_len], threshold))
        # Ours keeps the cache physically: per head, absolute positions and their stored scores.
        positions = [indices[0, h, : counts[0, h]].astype(np.int64) for h in range(heads)]
        assert not decoding or total > prompt_len
        for step in range(prompt_len, total if decoding else prompt_len):
            positions = [np.append(p, step) for p in positions]
            rows = [scores[h, p] for h, p in enumerate(positions)]
            # Each head is one row (its own physical length); the graph's heads axis carries copies.
            feed = compaction_feed(per_head_rows(rows, heads), [len(r) for r in rows], threshold)
            _, counts, indices = compaction.run(None, feed)
            positions = [p[indices[h, 0, : counts[h, 0]]] for h, p in enumerate(positions)]
        kept.append({(h, int(t)) for h in range(heads) for t in positions[h]})
    return kept, all_scores


@pytest.mark.parametrize("decoding", [False, True], ids=["prefill", "decoding"])
def test_masked_key_indices_reproduced(setup, decoding):
    llm, bundle, sessions, ids = setup
    prompt_len = ids.shape[1]
    # Thresholds from kvpress's own score distribution over the evictable prefix.
    _, _, probe_scores, _ = kvpress_run(llm, bundle / "surrogate", ids, threshold=-1e30, decoding=False)
    probe = np.concatenate([s[:, : prompt_len - WINDOW].ravel() for s in probe_scores])
    results = []
    for q in QUANTILES:
        threshold = float(np.quantile(probe, q))
        tol = tolerance(threshold)
        masked, hidden, ref_scores, pruned = kvpress_run(llm, bundle / "surrogate", ids, threshold, decoding)
        total = prompt_len + (NEW_TOKENS - 1 if decoding else 0)  # the last generated token is never fed
        assert all(h.shape[1] == total for h in hidden.values()) and all(s.shape[1] == total for s in ref_scores)
        kept, ours = our_kept(sessions, hidden, threshold, prompt_len, decoding)
        score_error = max(float(np.abs(o - r).max()) for o, r in zip(ours, ref_scores))
        assert score_error < tol, f"ORT surrogate scores differ from kvpress's by {score_error:.3g} >= TOL {tol:.3g}"
        flips = unexplained = 0
        for layer, (ours_kept, theirs) in enumerate(zip(kept, masked)):
            heads = ref_scores[layer].shape[0]
            assert all(b == 0 for b, _, _ in theirs)
            theirs_kept = {(h, t) for h in range(heads) for t in range(total)} - {(h, t) for _, h, t in theirs}
            for h, t in ours_kept ^ theirs_kept:
                flips += 1
                unexplained += abs(float(ref_scores[layer][h, t]) - threshold) > tol
        results.append({"quantile": q, "threshold": round(threshold, 5), "pruned": round(pruned, 4), "flips": flips,
                        "unexplained": unexplained, "max_score_error": score_error})
        assert 0.2 <= pruned <= 0.8, results
        assert unexplained == 0, results
    print(f"\ndecoding={decoding}: {results}")
