#!/usr/bin/env bash
# Trains the shipped SmolLM2-135M surrogates (linear and MLP) on this machine's CPU, offline, from the
# built-in corpus (scripts/install_corpus.sh installs it). Target collection is cached per prompt in
# $CACHE and resumes if interrupted. Wall time on the 2-core Intel Xeon of docs/benchmarks-history.md: see
# kvzap_export/assets/smollm2-135m/report/report.md (its last paragraph).
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${CACHE:-.cache/train_smollm2}
kvzap-export train --model smollm2-135m --variant both --out kvzap_export/assets/smollm2-135m \
  --prompts-per-domain 288 --held-out-prompts 10 --positions-per-prompt 0 --hidden-dim 144 --epochs 15 --weight-decay 0.03 --weight-decay 0.3 --seed 0 --cache-dir "$CACHE"
