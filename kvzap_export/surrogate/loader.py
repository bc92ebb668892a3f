"""Loading kvpress-format surrogate checkpoints, from a directory or the Hugging Face hub.

Safetensors only: a pickle checkpoint (``pytorch_model.bin``) is refused, because loading it runs
arbitrary code. Every checkpoint is checked against the model preset before it is used.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from kvzap_export.errors import WeightsError
from kvzap_export.presets import Preset
from kvzap_export.surrogate.model import CONFIG_NAME, WEIGHTS_NAME, Surrogate, SurrogateConfig, expected_state_shapes


def download_hint(repo_id: str) -> str:
    return f"hf download {repo_id} config.json model.safetensors --local-dir WEIGHTS_DIR, then pass --weights WEIGHTS_DIR"


def resolve_weights(preset: Preset, variant: str, weights: str | os.PathLike | None = None) -> Path:
    """Finds the checkpoint directory: ``--weights``, the toolkit's shipped copy, or the hub cache.

    The hub is tried from the local cache first; a download is attempted only when
    ``HF_HUB_OFFLINE`` is not set.
    """
    if weights is not None:
        path = Path(weights).expanduser()
        if not path.is_dir():
            raise WeightsError(f"--weights {weights}: not a directory; pass a directory holding {CONFIG_NAME} and {WEIGHTS_NAME}")
        return path
    builtin = preset.surrogate.builtin.get(variant)
    if builtin:
        base = Path(preset.source).parent if preset.source else Path.cwd()
        path = (base / builtin).resolve()
        if (path / WEIGHTS_NAME).is_file():
            return path
        raise WeightsError(f"preset {preset.name}: shipped {variant} surrogate missing at {path}; reinstall kvzap-export")
    repo_id = preset.hub_id(variant)
    if not repo_id:
        raise WeightsError(
            f"model {preset.name}: no surrogate hub id known for variant {variant!r}; "
            f"train one with `kvzap-export train` and pass --weights DIR"
        )
    return _from_hub(repo_id)


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = [CONFIG_NAME, WEIGHTS_NAME]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if not offline:
        try:
            return Path(snapshot_download(repo_id, allow_patterns=patterns))
        except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError):
            pass
    where = "offline mode (HF_HUB_OFFLINE)" if offline else "the hub could not be reached"
    raise WeightsError(f"surrogate weights {repo_id} not in the local cache and {where}; run: {download_hint(repo_id)}")


def read_config(directory: Path) -> SurrogateConfig:
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise WeightsError(f"{directory}: no {CONFIG_NAME}; expected a kvpress KVzap checkpoint (config.json + model.safetensors)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise WeightsError(f"{path}: unreadable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise WeightsError(f"{path}: expected a JSON object")
    missing = [k for k in ("input_dim", "output_dim", "n_modules") if k not in raw]
    if missing:
        raise WeightsError(f"{path}: missing KVzapConfig keys {missing}")
    values = {k: raw.get(k) for k in ("input_dim", "output_dim", "n_modules", "hidden_dim")}
    for key, value in values.items():
        if value is None and key == "hidden_dim":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise WeightsError(f"{path}: {key} must be a positive integer, got {value!r}")
    return SurrogateConfig(**values)


def check_against_preset(cfg: SurrogateConfig, preset: Preset, where: Path) -> None:
    """The checkpoint must fit the model: one scorer per layer, D inputs, one score per KV head."""
    pairs = [
        ("n_modules", cfg.n_modules, "num_layers", preset.num_layers),
        ("input_dim", cfg.input_dim, "hidden_size", preset.hidden_size),
        ("output_dim", cfg.output_dim, "num_kv_heads", preset.num_kv_heads),
    ]
    for ckpt_key, ckpt_value, preset_key, preset_value in pairs:
        if ckpt_value != preset_value:
            raise WeightsError(
                f"{where}: checkpoint {ckpt_key}={ckpt_value} but model {preset.name} has {preset_key}={preset_value}; "
                f"use the surrogate trained for {preset.name}"
            )


def load_state(directory: Path, cfg: SurrogateConfig) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = directory / WEIGHTS_NAME
    if not path.is_file():
        pickles = [p.name for p in directory.glob("*.bin")] + [p.name for p in directory.glob("*.pt")]
        extra = f" (found {pickles}: pickle checkpoints are refused; convert to safetensors)" if pickles else ""
        raise WeightsError(f"{directory}: no {WEIGHTS_NAME}{extra}")
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise WeightsError(f"{path}: corrupt or truncated safetensors file ({first}); download it again") from None
    expected = expected_state_shapes(cfg)
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise WeightsError(
            f"{path}: state-dict keys do not match a {cfg.variant} KVzap checkpoint "
            f"(missing {missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected {extra[:3]}{'...' if len(extra) > 3 else ''})"
        )
    for key, shape in expected.items():
        tensor = state[key]
        if tuple(tensor.shape) != shape:
            raise WeightsError(f"{path}: {key} has shape {list(tensor.shape)}, config implies {list(shape)}")
        if not tensor.is_floating_point():
            raise WeightsError(f"{path}: {key} has dtype {tensor.dtype}; surrogate weights must be floating point")
        if not torch.isfinite(tensor).all():
            # Refused, not warned: a NaN/inf weight makes every score NaN, and NaN scores are *kept*
            # (strict <), so the model would silently prune nothing.
            raise WeightsError(f"{path}: {key} contains NaN or inf values; the checkpoint is corrupt, re-train or re-download it")
    return state


def load_surrogate(directory: str | os.PathLike, preset: Preset | None = None) -> Surrogate:
    """Reads a kvpress checkpoint directory into a float32 ``Surrogate``, checked against ``preset``."""
    directory = Path(directory)
    cfg = read_config(directory)
    if preset is not None:
        check_against_preset(cfg, preset, directory)
    state = load_state(directory, cfg)
    model = Surrogate(cfg)
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()})
    return model.eval()
