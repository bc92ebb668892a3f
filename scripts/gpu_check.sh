#!/usr/bin/env bash
# One command that checks a GPU machine: correctness of every GPU path and the GPU figures, in about 7 minutes for the
# kernels and about 8 more for the SGLang engine.
#
#   bash scripts/gpu_check.sh OUTDIR [BUNDLE ...]
#   GPU_CHECK_STEPS=engine bash scripts/gpu_check.sh OUTDIR      (one part: kernels | engine; default all)
#
# Runs from a plain checkout (PYTHONPATH=. is enough: nothing is installed) on a machine with an NVIDIA GPU, torch,
# Triton, nvcc and compute-sanitizer; no network, TensorRT, onnxruntime-gpu or SGLang needed. Steps, each with its
# own time limit inside an overall budget ($GPU_CHECK_BUDGET seconds, default 420):
#   1. nvcc builds the CUDA library of plugins/ once (sm_90 and sm_80, PTX), in the background, while step 7 runs
#      first (the open issue's measurement: no budget cut reaches it) with the GPU to itself;
#   2. `validate --device cuda` on each BUNDLE (build them on a CPU machine beforehand, e.g. a float32 and a
#      bfloat16 bundle of the embedded model: `kvzap-export --model smollm2-135m --out B --no-validate [--dtype
#      bfloat16]`; the model's wheel is too large to travel, so the model level does not run there) - in the
#      background, on the CPU side, while 3-4 run;
#   3. the kernel tests that run compiled on a GPU (the decode decision, SGLang's decode kernel over the flattened
#      rows: with $KVZAP_SGLANG_KERNELS), then the GPU-marked tests (pytest -m gpu);
#   4. compute-sanitizer memcheck over the compaction kernels' exactness check (Triton and CUDA);
#   5. scripts/bench_kernels.py (fused compaction and K/V move vs the torch reference);
#   6. kvzap-export bench --device cuda (scoring, compaction, overhead vs an attention block);
#   7. scripts/bench_ragged_decode.py (ragged decode attention: ours vs SDPA over every and over the kept entries,
#      Llama-3.1-8B decode shapes; one decoder layer's decode step in CUDA graphs, dense vs ragged, replayed 50 steps
#      against eager, and its parts - front, K/V write, scoring, attention, back, decisions - each in its own graph,
#      naming the kernel);
#   8. SGLang 0.5.23 on this GPU (its own budget, $GPU_CHECK_ENGINE_BUDGET seconds, default 540), from two folders
#      built on a CPU machine and carried (else each of its steps is recorded as not run, with why): .gpu/engine
#      (SGLang and what it needs, scripts/sglang_gpu/build_engine.py) and .gpu/engine-check (tiny models and bundles
#      with kvpress's reference tokens, a Llama-3.1-8B-shaped config: scripts/sglang_gpu/prepare_engine_check.py).
#      engine_install: .gpu/engine/install.sh into $GPU_CHECK_WORK/site; SGLang's processes then run python3 with that
#      site, the checkout and the plugin's entry point (.gpu/engine-check/plugin) on PYTHONPATH, and
#      SGLANG_FORCE_FUSED_OP_BACKEND=torch (SGLang's JIT kernels need nvcc and tvm-ffi at run time: not yet seen to
#      build there; KVZAP_SGLANG_FUSED_OP_BACKEND=jit tries them). engine_parity_<model>_<mode>: validate --engine
#      sglang --device cuda on the tiny Llama and the tiny Qwen3 (the two models side by side, their modes one after
#      the other), ragged with SGLang's default CUDA graphs (the plugin turns the default prefill graphs off), mask and
#      evict with graphs off, --engine-arg sampling_backend=pytorch (no flashinfer) mem_fraction_static=0.3 (two
#      engines share the GPU): SGLang's greedy tokens vs kvpress's, and ragged mode's count of decode steps that
#      replayed a CUDA graph (0 fails). engine_dummy_bundle: the Llama-3.1-8B dummy-weights bundle (built here,
#      meanwhile). engine_bench_8k / engine_bench_32k: bench --engine sglang --device cuda --load-format dummy at
#      Llama-3.1-8B's shapes, bf16, one round (one run per configuration: not a median), a KV budget of 3 requests (8k
#      prompts; 12 requests x 512 new tokens: dense, ragged at 70% and 40% pruned, ragged with KVzap off) and of 1
#      request (32k prompts; 4 requests x 256 new tokens: dense, ragged at 70%), τ set by the pruned fraction
#      (KVZAP_PRUNED_FRACTION: dummy weights give meaningless scores), the dense baseline on SGLang's triton backend
#      (no flashinfer, no FlashAttention kernels there); each run is also saved as it finishes (--save-runs), so a
#      benchmark cut short still reports what ran.
# Then scripts/gpu_check_summary.py writes OUTDIR/gpu-check.json and OUTDIR/gpu-check.md (every figure with the
# device name) and sets the exit status: 0 (PASSED) only when every check ran and passed, 1 (FAILED) when one
# failed, 3 (INCOMPLETE) when nothing failed but something did not run, for any reason (each listed, with why, at
# the top of gpu-check.md, never shown passed: a step skipped, cut by the budget, missing here or not recorded; a
# test skipped; validate's own exit 3, e.g. the model level without the model, so with the bundles above a run is
# at best INCOMPLETE; a benchmark row skipped; a target not measured), 2 for usage or no GPU. Performance targets
# are reported as met / missed beside the checks; met / missed does not set the exit status.
#
# Optional, by environment:
#   KVZAP_WHEELS=DIR            wheels installed (pip --no-index --no-deps --target) before anything runs, e.g.
#                               onnxruntime-extensions for the plugin-node check;
#   KVZAP_SGLANG_KERNELS=PATH   SGLang 0.5.23's wheel, or a zip/folder holding its
#                               sglang/kernels/ops/attention/{decode_attention,score_mod}.py (steps 3 and 7);
#   PYTHON                      the interpreter (default python3);
#   GPU_CHECK_STEPS             all (default), kernels (steps 1-7) or engine (step 8): the other part's steps are
#                               recorded as not run (the verdict is then at best INCOMPLETE);
#   GPU_CHECK_ENGINE_BUDGET     step 8's budget in seconds (default 540), counted from its start;
#   GPU_CHECK_WORK              step 8's scratch folder (default /tmp/kvzap-gpu-check; emptied first): the installed
#                               engine and the 8B dummy bundle, kept out of OUTDIR;
#   KVZAP_SGLANG_ENGINE, KVZAP_ENGINE_CHECK   the two folders of step 8 (default .gpu/engine, .gpu/engine-check);
#   KVZAP_SGLANG_FUSED_OP_BACKEND   torch (default) or jit: SGLang's fused ops in step 8 (see above);
#   GPU_CHECK_COMMIT=REV        the commit the summary records, where the checkout's git metadata is not the tree's
#                               own (a copied working tree).
set -uo pipefail

if [ $# -lt 1 ] || [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  [ $# -lt 1 ] && exit 2 || exit 0
fi
OUT="$1"; shift
BUNDLES=("$@")
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET:-420}"
START=$(date +%s)
PART="${GPU_CHECK_STEPS:-all}"
case "$PART" in all|kernels|engine) ;; *) echo "gpu_check: GPU_CHECK_STEPS=$PART: use all, kernels or engine" >&2; exit 2 ;; esac

for i in "${!BUNDLES[@]}"; do
  b="${BUNDLES[$i]}"
  if [ ! -f "$b/manifest.json" ]; then
    echo "gpu_check: $b is not a bundle (no manifest.json); pass bundles written by kvzap-export --out" >&2
    exit 2
  fi
  BUNDLES[$i]="$(cd "$b" && pwd)"  # the steps run from the repository's root
done
if [ -e "$OUT" ] && [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then
  echo "gpu_check: $OUT is not empty; give a new folder (the summary reads every file a run leaves there)" >&2
  exit 2
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU is visible to torch on this machine ($PY); run it on a GPU machine" >&2
  exit 2
fi
mkdir -p "$OUT" || { echo "gpu_check: cannot create $OUT" >&2; exit 2; }
OUT="$(cd "$OUT" && pwd)"
: > "$OUT/steps.tsv"
cd "$REPO" || exit 2
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if [ -n "${KVZAP_WHEELS:-}" ]; then
  SITE="$OUT/site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$KVZAP_WHEELS"/*.whl \
    > "$OUT/wheels.log" 2>&1 && export PYTHONPATH="$PYTHONPATH:$SITE" || echo "gpu_check: wheels not installed (see wheels.log)" >&2
fi

left() { echo $(( BUDGET - ($(date +%s) - START) )); }

# step NAME LIMIT COMMAND...: runs COMMAND with the smaller of LIMIT and the budget left, logs to OUT/NAME.log and
# records "NAME rc seconds cut" (rc 124: time limit; cut 1 when the budget, not the step's own limit, stopped it:
# the summary counts that as not run; "skipped" when no budget is left).
step() {
  local name="$1" limit="$2"; shift 2
  local budget; budget=$(left)
  if [ "$budget" -le 5 ]; then
    printf '%s\tskipped\t0\t1\n' "$name" >> "$OUT/steps.tsv"
    echo "[gpu_check] $name: skipped (budget of ${BUDGET}s spent)" >&2
    return 0
  fi
  local cut=0
  if [ "$limit" -gt "$budget" ]; then limit="$budget"; cut=1; fi
  echo "[gpu_check] $name (limit ${limit}s) ..." >&2
  local t0; t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$cut" >> "$OUT/steps.tsv"
  echo "[gpu_check] $name: rc $rc in $(( $(date +%s) - t0 ))s" >&2
}
missing() {  # missing NAME WHY: a step this machine cannot run (recorded, counted as not run)
  printf '%s\tmissing\t0\t0\n' "$1" >> "$OUT/steps.tsv"
  echo "$2" > "$OUT/$1.log"
  echo "[gpu_check] $1: not run: $2" >&2
}
# "${TO_FILE[@]}" FILE COMMAND...: COMMAND's stdout into FILE, as a program `timeout` can run (the paths travel as
# arguments, not inside a shell string: any path works)
TO_FILE=(bash -c '"${@:2}" > "$1"' to_file)

KERNEL_STEPS=(build_cuda_library bench_ragged_decode pytest_kernels pytest_gpu sanitizer_memcheck bench_kernels bench_cuda)
kernel_part() {
# 1. the CUDA library, once for every step: nvcc works on the CPU, in the background, while the ragged decode benchmark
# (the open issue's measurement, first so that no budget cut reaches it) has the GPU to itself (its graphed figures
# do not depend on the host; its eager ones may feel nvcc's load)
LIB="$OUT/libkvzap_kernels.so"
rm -f "$LIB"
step build_cuda_library 120 "$PY" -c "import sys; from kvzap_export.kernels.cuda_lib import build_kernel_library as b; b(sys.argv[1])" "$LIB" &
BUILD_PID=$!

# 7 (run first). ragged decode attention and one layer's step, dense vs ragged, in CUDA graphs
if [ -z "${KVZAP_SGLANG_KERNELS:-}" ] && ! "$PY" -c 'import sglang' >/dev/null 2>&1; then
  missing bench_ragged_decode "SGLang's decode kernel: neither KVZAP_SGLANG_KERNELS nor an installed sglang"
else
  RAGGED_BUDGET=$(( $(left) - 60 )); [ "$RAGGED_BUDGET" -gt 150 ] && RAGGED_BUDGET=150
  step bench_ragged_decode 200 "$PY" scripts/bench_ragged_decode.py --json "$OUT/ragged-decode.json" \
    --budget-s "$RAGGED_BUDGET" ${KVZAP_SGLANG_KERNELS:+--sglang-kernels "$KVZAP_SGLANG_KERNELS"}
fi
wait "$BUILD_PID"
[ -f "$LIB" ] && export KVZAP_CUDA_LIB="$LIB"

# 2. validate --device cuda on each bundle, in the background (CPU work mostly)
VALIDATE_PIDS=()
i=0
for b in "${BUNDLES[@]}"; do
  i=$((i + 1))
  ( step "validate_$i" 200 "${TO_FILE[@]}" "$OUT/validate_$i.json" "$PY" -m kvzap_export.cli.main validate "$b" \
      --device cuda --json ${KVZAP_CUDA_LIB:+--cuda-lib "$KVZAP_CUDA_LIB"} ) &
  VALIDATE_PIDS+=($!)
  printf '%s\t%s\n' "validate_$i" "$b" >> "$OUT/bundles.tsv"
done

# 3. kernel tests that run on the GPU where there is one (not marked gpu: on a CPU they run interpreted)
step pytest_kernels 120 "$PY" -m pytest -q -m "not gpu" -p no:cacheprovider --junitxml "$OUT/pytest-kernels.xml" \
  tests/kernels/test_decode_decision.py tests/kernels/test_flattened_attention.py tests/kernels/test_flattened_step.py \
  tests/integrations/sglang/test_ragged_decode.py

# 3b. the GPU-marked tests
mapfile -t GPU_TESTS < <(grep -rl "mark.gpu" tests --include='test_*.py' | sort)
step pytest_gpu 150 "$PY" -m pytest -m gpu -q -p no:cacheprovider --junitxml "$OUT/pytest-gpu.xml" "${GPU_TESTS[@]}"

# 4. compute-sanitizer over the compaction kernels' exactness check
if command -v compute-sanitizer >/dev/null 2>&1; then
  step sanitizer_memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 86 \
    "$PY" scripts/bench_kernels.py --check --seq 4096 131072 ${KVZAP_CUDA_LIB:+--cuda-lib "$KVZAP_CUDA_LIB"}
else
  missing sanitizer_memcheck "compute-sanitizer is not on PATH"
fi

for pid in "${VALIDATE_PIDS[@]}"; do wait "$pid"; done  # timings below run on a quiet machine

# 5-6. the other timings
step bench_kernels 90 "$PY" scripts/bench_kernels.py --reps 30 --json "$OUT/bench-kernels.json" \
  ${KVZAP_CUDA_LIB:+--cuda-lib "$KVZAP_CUDA_LIB"}
step bench_cuda 150 "${TO_FILE[@]}" "$OUT/bench-cuda.json" "$PY" -m kvzap_export.cli.main bench --device cuda \
  --only scoring,compaction,overhead,e2e --json
}

if [ "$PART" = engine ]; then
  for name in "${KERNEL_STEPS[@]}"; do missing "$name" "not selected (GPU_CHECK_STEPS=engine)"; done
  i=0
  for b in "${BUNDLES[@]}"; do
    i=$((i + 1)); missing "validate_$i" "not selected (GPU_CHECK_STEPS=engine)"; printf '%s\t%s\n' "validate_$i" "$b" >> "$OUT/bundles.tsv"
  done
else
  kernel_part
fi

# 8. SGLang on this GPU (see the top): its own budget, counted from here
ENGINE_DIR="${KVZAP_SGLANG_ENGINE:-$REPO/.gpu/engine}"
CHECK_DIR="${KVZAP_ENGINE_CHECK:-$REPO/.gpu/engine-check}"
WORK="${GPU_CHECK_WORK:-/tmp/kvzap-gpu-check}"
PARITY_STEPS=(engine_parity_llama_ragged engine_parity_llama_mask engine_parity_llama_evict
              engine_parity_qwen3_ragged engine_parity_qwen3_mask engine_parity_qwen3_evict)
ENGINE_STEPS=(engine_install engine_dummy_bundle "${PARITY_STEPS[@]}" engine_bench_8k engine_bench_32k)
ok() { awk -F'\t' -v n="$1" '$1 == n { rc = $2 } END { exit rc == "0" ? 0 : 1 }' "$OUT/steps.tsv"; }
engine_part() {
  local why="" name
  [ -x "$ENGINE_DIR/install.sh" ] || why="no SGLang bundle at $ENGINE_DIR: build it on a CPU machine (python scripts/sglang_gpu/build_engine.py) and carry .gpu/engine"
  [ -n "$why" ] || [ -f "$CHECK_DIR/manifest.json" ] || why="no $CHECK_DIR/manifest.json: run python scripts/sglang_gpu/prepare_engine_check.py on a CPU machine and carry .gpu/engine-check"
  if [ -n "$why" ]; then
    for name in "${ENGINE_STEPS[@]}"; do missing "$name" "$why"; done
    return
  fi
  START=$(date +%s); BUDGET="${GPU_CHECK_ENGINE_BUDGET:-540}"
  rm -rf "$WORK" && mkdir -p "$WORK" || { for name in "${ENGINE_STEPS[@]}"; do missing "$name" "cannot create $WORK"; done; return; }
  step engine_install 180 "${TO_FILE[@]}" "$OUT/engine-install.env" bash "$ENGINE_DIR/install.sh" "$WORK/site"
  if ! ok engine_install; then
    for name in "${ENGINE_STEPS[@]:1}"; do missing "$name" "the engine did not install (engine_install.log)"; done
    return
  fi
  local fused="${KVZAP_SGLANG_FUSED_OP_BACKEND:-torch}"
  local env_args=(env "PYTHONPATH=$PYTHONPATH:$WORK/site:$CHECK_DIR/plugin")
  if [ "$fused" = jit ]; then env_args+=(-u SGLANG_FORCE_FUSED_OP_BACKEND); else env_args+=("SGLANG_FORCE_FUSED_OP_BACKEND=$fused"); fi
  "$PY" - "$OUT/engine-settings.json" "$fused" "$ENGINE_DIR" "$CHECK_DIR" <<'PY'
import json, sys
out, fused, engine, check = sys.argv[1:]
manifest = json.load(open(f"{check}/manifest.json"))
settings = {"fused_op_backend": fused, "engine_dir": engine, "engine_check_commit": manifest.get("kvzap_export_commit"),
            "parity_engine_args": "sampling_backend=pytorch mem_fraction_static=0.3",
            "bench_engine_args": "sampling_backend=pytorch; dense on triton, overlap on"}
try:  # what decides the ragged extend's attention kernel and the float32 Triton math on this machine
    import os
    import torch
    from torch.nn.attention import SDPBackend
    settings.update(torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                    triton_f32_default=os.environ.get("TRITON_F32_DEFAULT"))
    for dtype in (torch.bfloat16, torch.float32):  # a folded block as ragged_attention.prefix_extend_attention calls it
        q = torch.zeros(2, 8, 4 * 64, 128, dtype=dtype, device="cuda")
        kv = torch.zeros(2, 8, 300, 128, dtype=dtype, device="cuda")
        mask = torch.ones(2, 8, 4 * 64, 300, dtype=torch.bool, device="cuda")
        settings[f"sdpa_masked_{str(dtype)[6:]}"] = SDPBackend(torch._fused_sdp_choice(q, kv, kv, mask)).name
except Exception as error:  # a record, not a check: say what failed
    settings["runtime_facts_error"] = f"{type(error).__name__}: {error}"
json.dump(settings, open(out, "w"))
PY
  local pids=() model mode
  for model in llama qwen3; do
    (
      for mode in ragged mask evict; do
        name="engine_parity_${model}_${mode}"
        step "$name" 200 "${TO_FILE[@]}" "$OUT/$name.json" "${env_args[@]}" "$PY" -m kvzap_export.cli.main validate \
          "$CHECK_DIR/tiny-$model/bundle" --engine sglang --engine-mode "$mode" --model "$CHECK_DIR/tiny-$model/model" \
          --device cuda --engine-python "$PY" --json --engine-arg sampling_backend=pytorch \
          --engine-arg mem_fraction_static=0.3
      done
    ) &
    pids+=($!)
  done
  step engine_dummy_bundle 120 "$PY" scripts/sglang_gpu/prepare_engine_check.py --dummy-bundle "$WORK/llama-3.1-8b-bundle" \
    --config "$CHECK_DIR/llama-3.1-8b"
  for pid in "${pids[@]}"; do wait "$pid"; done  # the timings below run with the GPU to themselves
  if ! ok engine_dummy_bundle; then
    for name in engine_bench_8k engine_bench_32k; do missing "$name" "no dummy-weights bundle (engine_dummy_bundle.log)"; done
    return
  fi
  local bench=("${env_args[@]}" "$PY" -m kvzap_export.cli.main bench --engine sglang --device cuda
               --bundle "$WORK/llama-3.1-8b-bundle" --model "$CHECK_DIR/llama-3.1-8b" --engine-python "$PY"
               --load-format dummy --dense-backend triton --dense-overlap on --rounds 1
               --engine-arg sampling_backend=pytorch --json)
  step engine_bench_8k 300 "${TO_FILE[@]}" "$OUT/engine-bench-8k.json" "${bench[@]}" --prompt-tokens 8192 \
    --new-tokens 512 --requests 12 --pool-tokens $((3 * (8192 + 512 + 2))) --configs dense,ragged,ragged-off \
    --pruned-fraction 0.7,0.4 --save-runs "$OUT/engine-bench-8k.runs.jsonl"
  step engine_bench_32k 200 "${TO_FILE[@]}" "$OUT/engine-bench-32k.json" "${bench[@]}" --prompt-tokens 32768 \
    --new-tokens 256 --requests 4 --pool-tokens $((32768 + 256 + 2)) --configs dense,ragged --pruned-fraction 0.7 \
    --save-runs "$OUT/engine-bench-32k.runs.jsonl"
}
if [ "$PART" = kernels ]; then
  for name in "${ENGINE_STEPS[@]}"; do missing "$name" "not selected (GPU_CHECK_STEPS=kernels)"; done
else
  engine_part
fi
"$PY" scripts/gpu_check_summary.py "$OUT"
