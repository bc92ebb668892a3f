#!/usr/bin/env bash
# Trains the shipped SmolLM2-135M surrogates (linear and MLP) on this machine's CPU, offline.
# Target collection is cached per prompt in $CACHE and resumes if interrupted.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${CACHE:-.cache/train_smollm2}
kvzap-export train --model smollm2-135m --variant both --out kvzap_export/assets/smollm2-135m \
  --num-prompts 41 --positions-per-prompt 500 --epochs 15 --seed 0 --cache-dir "$CACHE"
