"""``train_surrogate``: the whole training pipeline as one public function."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import torch

from kvzap_export.errors import ConfigError
from kvzap_export.train.data import is_held_out


def _load(files: list[Path]) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor], int]:
    from safetensors.torch import load_file

    train_f, train_t, test_f, test_t, held = [], [], [], [], 0
    for path in files:
        index = int(path.stem.split("_")[-1])
        data = load_file(str(path))
        if is_held_out(index):
            test_f.append(data["features"])
            test_t.append(data["targets"])
            held += 1
        else:
            train_f.append(data["features"])
            train_t.append(data["targets"])
    if not train_f or not test_f:
        raise ConfigError("training needs at least 2 prompts (one is held out for evaluation); raise --num-prompts")
    return (torch.cat(train_f), torch.cat(train_t)), (torch.cat(test_f), torch.cat(test_t)), held


def train_surrogate(model: str, variant: str, out: Path, num_prompts: int = 48, positions_per_prompt: int = 500,
                    epochs: int = 15, seed: int = 0, cache_dir: Path | None = None, progress=None) -> dict:
    """Collects KVzip+ targets (cached, resumable), fits the variant(s), writes checkpoints and a report."""
    from kvzap_export.llm import load_llm
    from kvzap_export.presets import load_preset
    from kvzap_export.train.collect import collect_targets
    from kvzap_export.train.fit import fit_linear, fit_mlp
    from kvzap_export.train.report import predict, r2_per_head, write_report

    if variant not in ("linear", "mlp", "both"):
        raise ConfigError(f"--variant {variant!r}: use linear, mlp or both")
    if num_prompts < 2:
        raise ConfigError(f"--num-prompts {num_prompts}: at least 2 (one is held out)")
    preset = load_preset(model)
    start = time.time()
    llm, tokenizer = load_llm(model, attn_implementation="eager")
    cache = cache_dir or (out / "targets-cache")
    advance = progress("KVzip+ targets (repeat prompts)", num_prompts) if progress else None
    files = collect_targets(llm, tokenizer, cache, num_prompts, positions_per_prompt, seed,
                            on_prompt=(lambda _i, _c: advance()) if advance else None)
    collect_s = time.time() - start
    (train_x, train_y), (test_x, test_y), held = _load(files)
    variants = ["linear", "mlp"] if variant == "both" else [variant]
    results, notes = {}, []
    for name in variants:
        advance = progress(f"fit {name} surrogate per layer", preset.num_layers) if progress else None
        step = (lambda _l: advance()) if advance else None
        if name == "linear":
            surrogate = fit_linear(train_x, train_y, on_layer=step)
        else:
            surrogate, val = fit_mlp(train_x, train_y, preset.mlp_hidden_dim, epochs=epochs, seed=seed, on_layer=step)
            notes.append(f"MLP validation MSE (5% split of training pairs): mean {sum(val) / len(val):.3f}")
        target = out / name if variant == "both" else out
        surrogate.save(target)
        results[name] = r2_per_head(predict(surrogate, test_x), test_y)
    meta = {
        "model": preset.name, "num_prompts": len(files), "held_out_prompts": held, "train_pairs": int(train_x.shape[0]),
        "held_out_pairs": int(test_x.shape[0]), "positions_per_prompt": positions_per_prompt, "epochs": epochs, "seed": seed,
        "target_collection_s": round(collect_s, 1), "total_s": round(time.time() - start, 1),
        "command": "kvzap-export " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("kvzap-export") else
        f"kvzap-export train --model {model} --variant {variant} --out {out} --num-prompts {num_prompts}",
        "notes": notes,
    }
    summary = write_report(out / "report", results, meta)
    return {"meta": meta, "variants": {k: v["mean_r2"] for k, v in summary.items()}}
