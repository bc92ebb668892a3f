"""``train_surrogate``: the whole training pipeline as one public function."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from kvzap_export.errors import ConfigError
from kvzap_export.train.data import Prompt

IN_DOMAIN = "in-domain"  # the training domains' evaluation prompts, pooled


def _r2_per_domain(preds: dict[str, torch.Tensor], tests: dict[str, torch.Tensor], trained: set[str]) -> dict[str, torch.Tensor]:
    """R² (L, H) on each domain's evaluation pairs, and on the trained domains' pooled (IN_DOMAIN)."""
    from kvzap_export.train.report import r2_per_head

    out = {domain: r2_per_head(preds[domain], y) for domain, y in tests.items()}
    pooled = [d for d in tests if d in trained]
    if pooled:
        out[IN_DOMAIN] = r2_per_head(torch.cat([preds[d] for d in pooled]), torch.cat([tests[d] for d in pooled]))
    return out


def _fit(done, variants: list[str], hidden_dim: int, epochs: int, weight_decays: list[float], seed: int, progress, notes: list[str]):
    """Fits every layer of each variant, reading the cache in passes of as many layers as fit in memory.

    The MLP of each layer is fitted once per weight decay in ``weight_decays`` on the training prompts less the
    validation prompts (1 in 8); the one with the best validation R² is kept.

    Returns (surrogates, predictions per variant and evaluation domain (n, L, H), evaluation targets, fit seconds, pair counts,
    the MLP's weight decay per layer).
    """
    from kvzap_export.surrogate.model import Surrogate, SurrogateConfig
    from kvzap_export.train.fit import fit_linear_layer, fit_mlp_layer, layer_seed
    from kvzap_export.resources import available_memory
    from kvzap_export.train.pairs import layers_per_pass, prompt_split, read_layers, shapes
    from kvzap_export.train.report import r2_per_head

    counts, n_test, layers, dim, heads = shapes(done)
    n_train = sum(counts)
    span = layers_per_pass(n_train, n_test, layers, dim, heads, available_memory())
    passes = (layers + span - 1) // span
    surrogates = {name: Surrogate(SurrogateConfig(dim, heads, layers, hidden_dim if name == "mlp" else None)) for name in variants}
    preds: dict[str, dict[str, torch.Tensor]] = {name: {} for name in variants}
    targets: dict[str, torch.Tensor] = {}
    fit_s = dict.fromkeys(variants, 0.0)
    val_idx, train_idx = prompt_split(counts)
    chosen: list[tuple[float, float]] = []  # (weight decay, validation R²) per layer
    read = progress(f"read cached pairs ({passes} pass(es) of {span} layer(s))", passes * len(done)) if progress else None
    bars = {name: progress(f"fit {name} surrogate per layer", layers) for name in variants} if progress else {}
    for start in range(0, layers, span):
        stop = min(layers, start + span)
        (train_x, train_y), tests = read_layers(done, start, stop, n_train, read)
        for domain, (_, y) in tests.items():
            targets.setdefault(domain, torch.empty(len(y), layers, heads))[:, start:stop] = y
        for name in variants:
            for j, layer in enumerate(range(start, stop)):
                begin = time.time()
                if name == "linear":
                    module = fit_linear_layer(train_x[:, j], train_y[:, j])
                else:
                    best = None
                    for decay in weight_decays:
                        candidate, _ = fit_mlp_layer(train_x[:, j], train_y[:, j], hidden_dim, val_idx, train_idx,
                                                     layer_seed(seed, layer), epochs, weight_decay=decay)
                        with torch.no_grad():
                            pred = candidate(train_x[val_idx, j].float())
                        r2 = float(r2_per_head(pred[:, None], train_y[val_idx, j][:, None]).mean())
                        r2 = r2 if r2 == r2 else float("-inf")  # a diverged fit (NaN) is never kept over another
                        if best is None or r2 > best[2]:
                            best = (candidate, decay, r2)
                    module = best[0]
                    chosen.append(best[1:])
                fit_s[name] += time.time() - begin
                surrogates[name].layers[layer].load_state_dict(module.state_dict())
                with torch.no_grad():
                    for domain, (x, _) in tests.items():
                        preds[name].setdefault(domain, torch.empty(len(x), layers, heads))[:, layer] = module(x[:, j].float())
                if name in bars:
                    bars[name]()
        del train_x, train_y, tests
    if chosen:
        notes.append(f"MLP: fitted on {len(train_idx)} pairs; {len(val_idx)} pairs of every 8th training prompt kept for validation "
                     f"(mean validation R² {sum(r for _, r in chosen) / len(chosen):.3f}); weight decay per layer "
                     + (f"chosen from {weight_decays} by validation R²: " + ", ".join(f"{d:g}" for d, _ in chosen)
                        if len(weight_decays) > 1 else f"{weight_decays[0]:g}"))
    notes.append(f"pairs read from the cache in {passes} pass(es) of up to {span} layer(s)")
    return ({name: s.eval() for name, s in surrogates.items()}, preds, targets, {k: round(v, 1) for k, v in fit_s.items()},
            (n_train, n_test), [d for d, _ in chosen])


def _model_id(preset, llm) -> str:
    import hashlib

    return f"{preset.name}:{hashlib.sha256(llm.config.to_json_string(use_diff=False).encode()).hexdigest()[:16]}"


def _check_memory(prompts: list[Prompt], positions_per_prompt: int, preset) -> None:
    """Refuses a run of which not even one layer's pairs fit in memory (the fit reads the cache a span of layers at a time)."""
    from kvzap_export.train.data import MAX_TOKENS
    from kvzap_export.resources import available_memory
    from kvzap_export.train.pairs import MEMORY_SHARE, pass_bytes

    train = sum(1 for p in prompts if not p.test) * (positions_per_prompt or MAX_TOKENS)
    test = sum(1 for p in prompts if p.test) * MAX_TOKENS
    need = pass_bytes(train, test, 1, preset.hidden_size, preset.num_kv_heads)
    room = available_memory()
    if room is not None and need > MEMORY_SHARE * room:
        raise ConfigError(f"--positions-per-prompt {positions_per_prompt}: one layer's pairs would take up to {need / 2**30:.1f} GiB, "
                          f"more than {MEMORY_SHARE:.0%} of the {room / 2**30:.1f} GiB this process can use; keep fewer positions "
                          f"per prompt (e.g. 500) or fewer prompts")


def train_surrogate(model: str, variant: str, out: Path, prompts_per_domain: int = 48, held_out_prompts: int = 10,
                    positions_per_prompt: int = 0, epochs: int = 15, weight_decay: float | list[float] = 0.1, seed: int = 0, cache_dir: Path | None = None,
                    data: list[str] | None = None, progress=None, hidden_dim: int | None = None) -> dict:
    """Collects KVzip+ targets (cached, resumable), fits the variant(s), writes checkpoints and a per-domain report."""
    from kvzap_export.llm import load_llm
    from kvzap_export.presets import load_preset
    from kvzap_export.train.collect import collect_targets
    from kvzap_export.train.data import HOLDOUT_EVERY, corpus_prompts, load_corpus
    from kvzap_export.train.report import write_report
    from kvzap_export.train.sources import DOMAINS, SOURCES

    if variant not in ("linear", "mlp", "both"):
        raise ConfigError(f"--variant {variant!r}: use linear, mlp or both")
    if prompts_per_domain < 2:
        raise ConfigError(f"--prompts-per-domain {prompts_per_domain}: at least 2 (one in {HOLDOUT_EVERY} is kept for evaluation)")
    if held_out_prompts < 1:
        raise ConfigError(f"--held-out-prompts {held_out_prompts}: at least 1 per held-out domain")
    if positions_per_prompt < 0:
        raise ConfigError(f"--positions-per-prompt {positions_per_prompt}: 0 (all) or a positive count")
    weight_decays = [float(weight_decay)] if isinstance(weight_decay, (int, float)) else [float(d) for d in weight_decay]
    if not weight_decays or any(d < 0 for d in weight_decays):
        raise ConfigError(f"--weight-decay {weight_decay}: one or more non-negative values")
    if hidden_dim is not None and hidden_dim < 1:
        raise ConfigError(f"--hidden-dim {hidden_dim}: a positive width (default: the preset's surrogate.mlp_hidden_dim)")
    preset = load_preset(model)
    hidden_dim = hidden_dim or preset.mlp_hidden_dim
    notes: list[str] = []
    corpus = load_corpus(data, notes)  # a missing corpus or a bad --data file fails here, before the model loads
    start = time.time()
    llm, tokenizer = load_llm(model)
    prompts = corpus_prompts(tokenizer, corpus, prompts_per_domain, held_out_prompts, seed)
    _check_memory(prompts, positions_per_prompt, preset)
    cache = cache_dir or (out / "targets-cache")
    advance = progress(f"KVzip+ targets ({len(prompts)} repeat prompts)", len(prompts)) if progress else None
    done = collect_targets(llm, tokenizer, cache, prompts, positions_per_prompt, seed, model_id=_model_id(preset, llm),
                           on_prompt=(lambda _p, _c: advance()) if advance else None)
    collect_s = time.time() - start
    del llm
    load_llm.cache_clear()  # the model's memory goes to the fit
    trained = {p.domain for p, _ in done if not p.test}
    variants = ["linear", "mlp"] if variant == "both" else [variant]
    surrogates, preds, tests, fit_s, (n_train, _), decays = _fit(done, variants, hidden_dim, epochs, weight_decays, seed, progress, notes)
    results: dict[str, dict[str, torch.Tensor]] = {}
    for name, surrogate in surrogates.items():
        surrogate.save(out / name if variant == "both" else out)
        results[name] = _r2_per_domain(preds[name], tests, trained)
    counts: dict[str, dict[str, int]] = {}
    for prompt, _ in done:
        role = "train" if not prompt.test else "evaluation"
        counts.setdefault(prompt.domain, {"train": 0, "evaluation": 0})[role] += 1
    used = {p.domain for p, _ in done}
    meta = {
        "model": preset.name, "prompts": len(done), "train_pairs": n_train,
        "evaluation_pairs": {**{k: len(y) for k, y in tests.items()}, IN_DOMAIN: sum(len(y) for k, y in tests.items() if k in trained)},
        "prompts_per_domain": counts,
        "held_out_domains": sorted(d for d in tests if d not in trained),
        "domains": {d: DOMAINS.get(d, "your data (--data)") for d in sorted(used)},
        "sources": [{"name": s.name, "domain": s.domain, "title": s.title, "licence": s.licence, "provider": s.provider}
                    for s in SOURCES if s.domain in used],
        "data": list(data) if data else None, "positions_per_prompt": positions_per_prompt, "epochs": epochs,
        "mlp_hidden_dim": hidden_dim if "mlp" in variants else None,
        "weight_decay": weight_decays, "weight_decay_per_layer": decays or None, "seed": seed,
        "target_collection_s": round(collect_s, 1), "fit_s": fit_s, "total_s": round(time.time() - start, 1),
        "command": "kvzap-export " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("kvzap-export") else
        f"kvzap-export train --model {model} --variant {variant} --out {out}",
        "notes": notes,
    }
    summary = write_report(out / "report", results, meta)
    return {"meta": meta, "variants": summary}
