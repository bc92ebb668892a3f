"""``train_surrogate``: the whole training pipeline as one public function."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from kvzap_export.errors import ConfigError
from kvzap_export.train.data import Prompt

IN_DOMAIN = "in-domain"  # the training domains' evaluation prompts, pooled


def _load(done: list[tuple[Prompt, Path]]) -> tuple[tuple[torch.Tensor, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Training pairs in one preallocated tensor (no second copy), evaluation pairs per domain."""
    from safetensors import safe_open

    train = [path for p, path in done if not p.test]
    with safe_open(str(train[0]), framework="pt") as f:
        (_, layers, dim), (_, _, heads) = f.get_slice("features").get_shape(), f.get_slice("targets").get_shape()
    n = 0
    for path in train:
        with safe_open(str(path), framework="pt") as f:
            n += f.get_slice("features").get_shape()[0]
    train_x, train_y = torch.empty(n, layers, dim, dtype=torch.float16), torch.empty(n, layers, heads)
    tests: dict[str, tuple[list, list]] = {}
    row = 0
    for prompt, path in done:
        with safe_open(str(path), framework="pt") as f:
            x, y = f.get_tensor("features"), f.get_tensor("targets")
        if prompt.test:
            tests.setdefault(prompt.domain, ([], []))[0].append(x)
            tests[prompt.domain][1].append(y)
        else:
            train_x[row:row + len(x)], train_y[row:row + len(x)] = x, y
            row += len(x)
    return (train_x, train_y), {k: (torch.cat(xs), torch.cat(ys)) for k, (xs, ys) in tests.items()}


def _r2_per_domain(surrogate, tests: dict[str, tuple[torch.Tensor, torch.Tensor]], trained: set[str]) -> dict[str, torch.Tensor]:
    """R² (L, H) on each domain's evaluation pairs, and on the trained domains' pooled (IN_DOMAIN)."""
    from kvzap_export.train.report import predict, r2_per_head

    out, pooled = {}, []
    for domain, (x, y) in tests.items():
        pred = predict(surrogate, x)
        out[domain] = r2_per_head(pred, y)
        if domain in trained:
            pooled.append((pred, y))
    if pooled:
        out[IN_DOMAIN] = r2_per_head(torch.cat([p for p, _ in pooled]), torch.cat([y for _, y in pooled]))
    return out


def _model_id(preset, llm) -> str:
    import hashlib

    return f"{preset.name}:{hashlib.sha256(llm.config.to_json_string(use_diff=False).encode()).hexdigest()[:16]}"


def _check_memory(prompts: list[Prompt], positions_per_prompt: int, preset) -> None:
    """Refuses a run whose features would not fit in memory (float16 training and evaluation sets, one layer's fit)."""
    import os

    from kvzap_export.train.data import MAX_TOKENS

    per_position = preset.num_layers * preset.hidden_size * 2
    train = sum(1 for p in prompts if not p.test) * (positions_per_prompt or MAX_TOKENS)
    test = sum(1 for p in prompts if p.test) * MAX_TOKENS
    need = (train + test) * per_position + 4 * 4 * (train * preset.hidden_size)  # + one layer's float64 ridge copies
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if need > 0.8 * total:
        raise ConfigError(f"--positions-per-prompt {positions_per_prompt}: the features would take up to {need / 2**30:.0f} GiB, "
                          f"more than this machine's {total / 2**30:.0f} GiB allows; keep fewer positions per prompt (e.g. 500) "
                          f"or fewer prompts")


def train_surrogate(model: str, variant: str, out: Path, prompts_per_domain: int = 48, held_out_prompts: int = 10,
                    positions_per_prompt: int = 0, epochs: int = 15, weight_decay: float = 0.1, seed: int = 0, cache_dir: Path | None = None,
                    data: list[str] | None = None, progress=None) -> dict:
    """Collects KVzip+ targets (cached, resumable), fits the variant(s), writes checkpoints and a per-domain report."""
    from kvzap_export.llm import load_llm
    from kvzap_export.presets import load_preset
    from kvzap_export.train.collect import collect_targets
    from kvzap_export.train.data import HOLDOUT_EVERY, corpus_prompts, load_corpus
    from kvzap_export.train.fit import fit_linear, fit_mlp
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
    preset = load_preset(model)
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
    (train_x, train_y), tests = _load(done)
    trained = {p.domain for p, _ in done if not p.test}
    variants = ["linear", "mlp"] if variant == "both" else [variant]
    results: dict[str, dict[str, torch.Tensor]] = {}
    fit_s = {}
    for name in variants:
        fit_start = time.time()
        advance = progress(f"fit {name} surrogate per layer", preset.num_layers) if progress else None
        step = (lambda _l: advance()) if advance else None
        if name == "linear":
            surrogate = fit_linear(train_x, train_y, on_layer=step)
        else:
            surrogate, val = fit_mlp(train_x, train_y, preset.mlp_hidden_dim, epochs=epochs, weight_decay=weight_decay,
                                    seed=seed, on_layer=step)
            notes.append(f"MLP validation MSE (5% split of training pairs): mean {sum(val) / len(val):.3f}")
        fit_s[name] = round(time.time() - fit_start, 1)
        surrogate.save(out / name if variant == "both" else out)
        results[name] = _r2_per_domain(surrogate, tests, trained)
    counts: dict[str, dict[str, int]] = {}
    for prompt, _ in done:
        role = "train" if not prompt.test else "evaluation"
        counts.setdefault(prompt.domain, {"train": 0, "evaluation": 0})[role] += 1
    used = {p.domain for p, _ in done}
    meta = {
        "model": preset.name, "prompts": len(done), "train_pairs": int(train_x.shape[0]),
        "evaluation_pairs": {**{k: int(x.shape[0]) for k, (x, _) in tests.items()},
                             IN_DOMAIN: sum(int(x.shape[0]) for k, (x, _) in tests.items() if k in trained)}, "prompts_per_domain": counts,
        "held_out_domains": sorted(d for d in tests if d not in trained),
        "domains": {d: DOMAINS.get(d, "your data (--data)") for d in sorted(used)},
        "sources": [{"name": s.name, "domain": s.domain, "title": s.title, "licence": s.licence, "provider": s.provider}
                    for s in SOURCES if s.domain in used],
        "data": list(data) if data else None, "positions_per_prompt": positions_per_prompt, "epochs": epochs,
        "weight_decay": weight_decay, "seed": seed,
        "target_collection_s": round(collect_s, 1), "fit_s": fit_s, "total_s": round(time.time() - start, 1),
        "command": "kvzap-export " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("kvzap-export") else
        f"kvzap-export train --model {model} --variant {variant} --out {out}",
        "notes": notes,
    }
    summary = write_report(out / "report", results, meta)
    return {"meta": meta, "variants": summary}
