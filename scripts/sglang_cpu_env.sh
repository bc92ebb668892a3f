#!/usr/bin/env bash
# Creates (or refreshes) a virtualenv at DIR in which SGLang 0.5.23 runs on a CPU-only machine, with this
# checkout installed editable, so that KVzap's SGLang glue runs inside the real engine
# (`kvzap-export validate BUNDLE --engine sglang --sglang-python DIR/bin/python`, tests marked `sglang`).
#
#   bash scripts/sglang_cpu_env.sh DIR
#
# Why a separate environment: sglang 0.5.23 wants transformers 5.19 while kvpress 0.5.5 (the reference)
# caps it below 5.3, so the kvpress reference is computed in the main environment and carried by the
# bundle. What is installed, and why (facts of ../shared/notes/sglang-cpu.md, re-checked here):
#   - CPU torch 2.13.0 first (sglang pins torch 2.14.1, for which only a CUDA build exists; pip warns);
#   - sglang itself with --no-deps, then its pure-Python requirements by name: none of its CUDA
#     packages (sglang-kernel, flashinfer, flash-attn, cutlass, deep-gemm, ...) nor torchvision (the
#     registry's build is a CUDA one);
#   - triton and soundfile, which SGLang imports unconditionally, and torchvision 0.28.0 (the build paired
#     with torch 2.13.0; SGLang imports it whatever the model): its CUDA-only extension cannot load with CPU
#     torch, so scripts/sglang_cpu/kvzap_torchvision_ops.py defines the two operator schemas its import needs;
#   - scripts/sglang_cpu/sgl_kernel: plain-torch versions of the two sgl-kernel CPU ops SGLang imports on
#     this path (sgl-kernel has no CPU build on the registry). Both stand-ins are put on this environment's
#     path by one .pth file; they are not part of the kvzap_export package and never reach a GPU install.
# Takes about 3 minutes with a warm pip cache; the environment is about 3 GB.
set -euo pipefail

if [ $# -ne 1 ] || [ -z "$1" ]; then
  echo "usage: bash scripts/sglang_cpu_env.sh DIR   (DIR: the virtualenv to create or refresh)" >&2
  exit 2
fi
DIR="$1"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"

step() { echo "[sglang-cpu-env] $*" >&2; }

if [ ! -x "$DIR/bin/python" ]; then
  step "creating the virtualenv $DIR"
  "$PY" -m venv "$DIR"
fi
PIP=("$DIR/bin/python" -m pip install -q --disable-pip-version-check)

step "CPU torch 2.13.0"
"${PIP[@]}" torch==2.13.0
step "sglang 0.5.23 (no dependencies) and its pure-Python requirements"
"${PIP[@]}" --no-deps sglang==0.5.23
"${PIP[@]}" torch==2.13.0 \
  aiohttp "anthropic>=0.20.0" blobfile==3.0.0 build compressed-tensors==0.18.0 datasets distro easydict einops \
  fastapi gguf interegular IPython "llguidance>=1.7.6,<2" "mistral_common>=1.11.5" msgspec ninja numpy \
  nvidia-ml-py openai==2.8.0 openai-harmony==0.0.4 orjson packaging partial_json_parser pillow \
  "prometheus-client>=0.20.0" psutil pybase64 pydantic "python-dateutil<3" python-multipart "pyzmq>=25.1.2" \
  regex requests scipy sentencepiece==0.2.1 setproctitle tiktoken tokenizers==0.23.2 tqdm transformers==5.19.0 \
  "uvicorn>=0.51" uvloop watchfiles xxhash zstandard triton==3.7.1 soundfile==0.13.1
"${PIP[@]}" --no-deps xgrammar==0.2.7 apache-tvm-ffi==0.1.11 torchvision==0.28.0
step "this checkout (editable) and the sgl_kernel CPU stand-in"
"${PIP[@]}" torch==2.13.0 -e "$REPO"
SITE="$("$DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
printf '%s\nimport kvzap_torchvision_ops; kvzap_torchvision_ops.install()\n' "$REPO/scripts/sglang_cpu" \
  > "$SITE/kvzap_sglang_cpu_shim.pth"

step "checking: import sglang, the plugin entry point, the CPU ops"
SGLANG_USE_CPU_ENGINE=1 "$DIR/bin/python" - <<'PY'
import importlib.metadata

import sglang  # noqa: F401
import sgl_kernel
from sglang.srt.mem_cache import allocation  # imports sgl_kernel.assign_req_to_token_pool_cpu on the CPU

assert sgl_kernel.__file__.endswith("scripts/sglang_cpu/sgl_kernel/__init__.py"), sgl_kernel.__file__
found = [ep.value for ep in importlib.metadata.entry_points(group="sglang.srt.plugins") if ep.name == "kvzap"]
assert found == ["kvzap_export.integrations.sglang.plugin:load_plugin"], found
print(f"sglang {importlib.metadata.version('sglang')}, torch {importlib.metadata.version('torch')}, "
      f"transformers {importlib.metadata.version('transformers')}: ready")
PY
step "done: $DIR/bin/python"
