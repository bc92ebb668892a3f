#!/usr/bin/env python
"""Two trained surrogates scored on the same evaluation text: prompts that neither training run trained on.

    python scripts/compare_surrogates.py OLD_DIR NEW_DIR --old-prompts 144 --new-prompts 288 \
        --cache-dir .cache/train_smollm2

A run with more prompts per domain picks a larger in-domain evaluation set (1 in 8 of its picks), so the R² of two
runs' reports are taken on different text. This script rebuilds both runs' prompt lists from the built-in corpus,
keeps the training domains' evaluation prompts of the old run that the new run did not train on either (and the
held-out domains' prompts, the same in both), and scores both surrogates on their cached KVzip+ targets (the files
``kvzap-export train --cache-dir`` wrote; a missing one is an error, nothing is collected here). Prints one table of
mean R² over layer x KV head and the worst layer's mean.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path, help="the first surrogate's directory (config.json + model.safetensors)")
    parser.add_argument("new", type=Path, help="the second surrogate's directory")
    parser.add_argument("--old-prompts", type=int, required=True, help="--prompts-per-domain of the run that trained OLD")
    parser.add_argument("--new-prompts", type=int, required=True, help="--prompts-per-domain of the run that trained NEW")
    parser.add_argument("--held-out-prompts", type=int, default=10)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--cache-dir", type=Path, required=True, help="the --cache-dir both runs used")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch

    from kvzap_export.errors import KvzapError
    from kvzap_export.llm import load_llm
    from kvzap_export.surrogate.loader import load_surrogate
    from kvzap_export.train.data import corpus_prompts, load_corpus
    from kvzap_export.train.pairs import read_layers, shapes
    from kvzap_export.train.report import predict, r2_per_head
    from kvzap_export.train.sources import HELD_OUT_DOMAINS

    try:
        corpus = load_corpus()  # the built-in corpus the two runs trained on (scripts/install_corpus.sh)
        _, tokenizer = load_llm(args.model)
        old = corpus_prompts(tokenizer, corpus, args.old_prompts, args.held_out_prompts, args.seed)
        new = corpus_prompts(tokenizer, corpus, args.new_prompts, args.held_out_prompts, args.seed)
        surrogates = {"old": load_surrogate(args.old), "new": load_surrogate(args.new)}
    except KvzapError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    trained = {p.digest for p in old + new if not p.test}
    common = [p for p in old if p.test and p.domain not in HELD_OUT_DOMAINS and p.digest not in trained]
    sets = {f"in-domain, trained on by neither ({len(common)} prompts)": common}
    for domain in HELD_OUT_DOMAINS:
        sets[f"{domain} (held out)"] = [p for p in new if p.domain == domain]

    print("| text | positions | old mean R² | old worst layer | new mean R² | new worst layer |")
    print("|---|---|---|---|---|---|")
    for name, prompts in sets.items():
        done = [(prompt, args.cache_dir / "targets" / f"{prompt.key}.safetensors") for prompt in prompts]
        missing = next((path for _, path in done if not path.is_file()), None)
        if missing is not None:
            print(f"error: {missing} is not cached; run kvzap-export train with --prompts-per-domain "
                  f"{args.old_prompts} and {args.new_prompts} on --cache-dir {args.cache_dir} first", file=sys.stderr)
            return 2
        _, tests = read_layers(done, 0, shapes(done)[2], 0)  # every prompt here is an evaluation prompt
        x, y = (torch.cat(parts) for parts in zip(*tests.values()))
        cells = []
        for surrogate in surrogates.values():
            r2 = r2_per_head(predict(surrogate, x), y)
            cells += [f"{r2.mean():.3f}", f"{r2.mean(1).min():.3f}"]
        print(f"| {name} | {len(x)} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
