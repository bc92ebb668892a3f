"""What each engine layout frees on the embedded model: ragged (per head), one count per layer, uniform.

SmolLM2-135M-Instruct with its shipped MLP surrogate, the 600-token prompt of the kvpress parity test,
64 greedy tokens generated (63 fed back), window 128; the core's ``RequestState`` replays prefill + decode.
Prints one line per (τ, decoding) and, for the preset's τ, each layer's largest kept fraction over heads.

    python scripts/integration_layouts.py            # ≈1.5 min on 2 CPU cores
"""

from __future__ import annotations

import torch
from pydoc_data.topics import topics

from kvzap_export.integrations.core import KVzapPolicy, RequestState
from kvzap_export.integrations.scoring import BundleScorer
from kvzap_export.llm import capture_hidden_states, load_llm
from kvzap_export.presets import load_preset
from kvzap_export.surrogate import load_surrogate, resolve_weights

PROMPT, NEW, WINDOW = 600, 64, 128


def replay(scores: torch.Tensor, tau: float, decoding: bool, layout: str) -> RequestState:
    state = RequestState(KVzapPolicy(tau, window=WINDOW, decoding=decoding, layout=layout), *scores.shape[:2])
    state.prefill(scores[..., :PROMPT])
    for t in range(PROMPT, scores.shape[-1]):
        state.decode(scores[..., t: t + 1])
    return state


def main() -> None:
    preset = load_preset("smollm2-135m")
    llm, tokenizer = load_llm("smollm2-135m")
    ids = tokenizer(topics["for"] + topics["while"] + topics["try"], return_tensors="pt").input_ids[:, :PROMPT]
    with torch.no_grad(), capture_hidden_states(llm) as hidden:
        llm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        hidden = {k: v.clone() for k, v in hidden.items()}
    scorer = BundleScorer(load_surrogate(resolve_weights(preset, "mlp"), preset))
    with torch.no_grad():
        scores = torch.stack([scorer.score(layer, hidden[layer][0]).T for layer in range(scorer.num_layers)])
    layers, heads, total = scores.shape
    torch.set_num_threads(1)  # tiny tensors
    for tau in (preset.pruning.threshold, -4.791, -5.574):
        for decoding in (True, False):
            ragged = replay(scores, tau, decoding, "ragged")
            uniform = replay(scores, tau, decoding, "uniform")
            freed = 1 - float(ragged.counts.sum()) / (layers * heads * total)
            per_layer = 1 - float(ragged.counts.amax(1).sum()) / (layers * total)
            print(f"tau={tau} decoding={decoding} entries/head={total}: freed ragged {freed:.3f}, "
                  f"one count per layer {per_layer:.3f}, uniform {1 - uniform.physical_length / total:.3f}")
    ragged = replay(scores, preset.pruning.threshold, True, "ragged")
    print("largest kept fraction per layer:", [round(float(c.max()) / total, 2) for c in ragged.counts])


if __name__ == "__main__":
    main()
