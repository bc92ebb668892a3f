"""``.gpu/engine-check/``: what it holds, the Llama-3.1-8B-shaped config, the plugin's entry point, sizes (pure).

Layout::

    manifest.json                       what is here: models, bundles, seeds, τ, reference prompts, sizes, commit
    tiny-llama/model/                   export-model tiny-llama --byte-vocab (float32, seeded)
    tiny-llama/bundle/                  its bundle (τ = 0) with report/reference.json: kvpress's greedy tokens
    tiny-qwen3/model/, tiny-qwen3/bundle/   the same for the tiny Qwen3
    llama-3.1-8b/                       config.json + generation_config.json: Llama-3.1-8B-Instruct's shapes, no weights
                                        and no tokenizer (SGLang builds the model from the config, --load-format dummy)
    plugin/kvzap_export-<v>.dist-info/  METADATA + entry_points.txt: SGLang finds the plugin of a checkout that is on
                                        PYTHONPATH but not installed (it looks the entry point up in installed metadata)

The dummy-weights bundle for llama-3.1-8b (a seeded random linear surrogate, 6 MB) is not carried: gpu_check.sh builds it
there in seconds (``prepare_engine_check.py --dummy-bundle``), which keeps this folder within a few MB.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

TINY_MODELS = ("tiny-llama", "tiny-qwen3")
LLAMA_8B = "llama-3.1-8b"
PLUGIN_DIR = "plugin"
ENTRY_GROUP = "sglang.srt.plugins"
THRESHOLD = 0.0  # the tiny models' surrogates score around 0: τ = 0 prunes about a third of their prompts' entries
PROMPTS, NEW_TOKENS = 3, 24  # kvpress's reference: what the engine tests carry (3 prompts x 24 tokens)

# Llama-3.1-8B-Instruct's published config.json, shapes and RoPE settings (the architecture SGLang builds with
# --load-format dummy: random weights of the real sizes, bf16).
LLAMA_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "_name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "initializer_range": 0.02, "pretraining_tp": 1, "torch_dtype": "bfloat16", "use_cache": True,
}
LLAMA_8B_GENERATION = {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "do_sample": False}


def write_config_dir(dest: Path) -> None:
    """``dest/``: the Llama-3.1-8B-shaped config.json and generation_config.json (no weights, no tokenizer)."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(LLAMA_8B_CONFIG, indent=2) + "\n")
    (dest / "generation_config.json").write_text(json.dumps(LLAMA_8B_GENERATION, indent=2) + "\n")


def plugin_entry_points(pyproject: Path) -> dict[str, str]:
    """The checkout's ``sglang.srt.plugins`` entry points (name -> "module:function"), read from its pyproject.toml."""
    try:
        project = tomllib.loads(pyproject.read_text())["project"]
    except (OSError, KeyError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{pyproject}: no [project] table to read the plugin's entry point from ({exc})") from None
    points = project.get("entry-points", {}).get(ENTRY_GROUP) or {}
    if not points:
        raise ValueError(f"{pyproject}: no [project.entry-points.\"{ENTRY_GROUP}\"]: SGLang would not load the plugin")
    return dict(points)


def plugin_dist_files(name: str, version: str, entry_points: dict[str, str]) -> dict[str, str]:
    """The dist-info that makes ``importlib.metadata`` list the plugin's entry points for a checkout on PYTHONPATH:
    relative path -> text. Marked as a checkout's, not an installed package's."""
    folder = f"{re.sub(r'[-_.]+', '_', name)}-{version}.dist-info"
    metadata = (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                "Summary: entry points of a kvzap-export checkout on PYTHONPATH (gpu_check.sh's SGLang steps); "
                "the code is the checkout's, not installed\n")
    points = f"[{ENTRY_GROUP}]\n" + "".join(f"{key} = {value}\n" for key, value in sorted(entry_points.items()))
    return {f"{folder}/METADATA": metadata, f"{folder}/entry_points.txt": points,
            f"{folder}/INSTALLER": "scripts/sglang_gpu/prepare_engine_check.py\n"}


def write_files(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def sizes(root: Path) -> dict[str, int]:
    """Bytes per top-level entry of ``root`` (a folder counts every file under it)."""
    out = {}
    for entry in sorted(root.iterdir()):
        files = [entry] if entry.is_file() else [p for p in entry.rglob("*") if p.is_file()]
        out[entry.name] = sum(p.stat().st_size for p in files)
    return out


def check_limit(total: int, limit: int) -> None:
    if total > limit:
        raise ValueError(f"the folder is {total / 1e6:.1f} MB, over the {limit / 1e6:.1f} MB limit (it travels beside the "
                         "checkout and .gpu/engine, 64 MiB in all)")
