"""Model presets: the dimensions of an LLM and where its KVzap surrogates live.

A preset is data (``kvzap_export/configs/*.yaml``, also reachable as ``configs/`` at the repository
root). ``--model`` also accepts a YAML file of the same shape, a local Hugging Face model directory,
or its ``config.json`` for any Llama/Qwen/Mistral-style architecture.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvzap_export.errors import ConfigError

CONFIG_DIR = Path(__file__).parent / "configs"
VARIANTS = ("linear", "mlp")


@dataclass(frozen=True)
class SurrogateSpec:
    """Where a preset's surrogates come from and the MLP width."""

    default_variant: str = "mlp"
    mlp_hidden_dim: int | None = None
    hub_ids: dict[str, str] = field(default_factory=dict)
    # Directory (relative to the preset file) holding checkpoints shipped with the toolkit.
    builtin: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PruningSpec:
    threshold: float = -4.0
    thresholds_reported: tuple[float, ...] = ()
    window: int = 128
    sink: int = 0


@dataclass(frozen=True)
class Preset:
    """Dimensions of one LLM as KVzap sees it."""

    name: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hf_id: str | None = None
    architecture: str | None = None
    model_dtype: str = "bfloat16"
    max_position_embeddings: int = 131072
    surrogate: SurrogateSpec = field(default_factory=SurrogateSpec)
    pruning: PruningSpec = field(default_factory=PruningSpec)
    source: str = ""
    # Where to find the model itself offline (used by the embedded default).
    model_source: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in ("hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"preset {self.name!r}: {key} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ConfigError(
                f"preset {self.name!r}: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}; fix the preset's head counts"
            )
        if self.surrogate.default_variant not in VARIANTS:
            raise ConfigError(
                f"preset {self.name!r}: surrogate.default_variant={self.surrogate.default_variant!r}; "
                f"use one of {list(VARIANTS)}"
            )
        hidden = self.surrogate.mlp_hidden_dim
        if hidden is not None and (not isinstance(hidden, int) or isinstance(hidden, bool) or hidden <= 0):
            raise ConfigError(f"preset {self.name!r}: surrogate.mlp_hidden_dim must be a positive integer, got {hidden!r}")
        window = self.pruning.window
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise ConfigError(f"preset {self.name!r}: pruning.window must be a positive integer, got {window!r}")

    @property
    def mlp_hidden_dim(self) -> int:
        return self.surrogate.mlp_hidden_dim or self.hidden_size // 8

    def hub_id(self, variant: str) -> str | None:
        return self.surrogate.hub_ids.get(variant)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def list_presets() -> list[str]:
    """Names of the presets shipped with the toolkit, sorted."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def _build(data: Any, name_hint: str, source: str) -> Preset:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a preset must be a YAML mapping, got {type(data).__name__}")
    data = dict(data)
    surrogate = data.pop("surrogate", None) or {}
    pruning = data.pop("pruning", None) or {}
    if not isinstance(surrogate, dict) or not isinstance(pruning, dict):
        raise ConfigError(f"{source}: 'surrogate' and 'pruning' must be mappings")
    data.setdefault("name", name_hint)
    known = {f.name for f in dataclasses.fields(Preset)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{source}: unknown preset keys {unknown}; known keys: {sorted(known)}")
    missing = [k for k in ("hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim") if k not in data]
    if missing:
        raise ConfigError(f"{source}: missing required keys {missing}")
    try:
        surrogate_spec = SurrogateSpec(**surrogate)
        pruning = dict(pruning)
        if "thresholds_reported" in pruning:
            pruning["thresholds_reported"] = tuple(float(t) for t in pruning["thresholds_reported"])
        if "threshold" in pruning:
            pruning["threshold"] = float(pruning["threshold"])
        pruning_spec = PruningSpec(**pruning)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: bad 'surrogate' or 'pruning' section: {exc}") from None
    return Preset(**data, surrogate=surrogate_spec, pruning=pruning_spec, source=source)


def _from_yaml(path: Path) -> Preset:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        where = f" at line {line + 1}" if line is not None else ""
        raise ConfigError(f"{path}: malformed YAML{where}; fix the file syntax") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read preset ({exc.strerror})") from None
    return _build(data, path.stem, str(path))


def from_hf_config(path: Path) -> Preset:
    """Builds a preset from a Hugging Face ``config.json`` (Llama/Qwen/Mistral-style decoders)."""
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable JSON model config ({exc})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: a model config must be a JSON object")
    cfg = cfg.get("text_config", cfg)  # multimodal wrappers keep the decoder under text_config
    needed = ("hidden_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in needed if k not in cfg]
    if missing:
        raise ConfigError(f"{path}: model config lacks {missing}; is this a decoder-only LLM config.json?")
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None)
    archs = cfg.get("architectures") or [None]
    name = cfg.get("_name_or_path") or path.parent.name
    basename = str(name).rstrip("/").split("/")[-1]
    return _build(
        {
            "name": basename,
            "hf_id": cfg.get("_name_or_path") or None,
            "architecture": archs[0],
            "hidden_size": hidden,
            "num_layers": cfg["num_hidden_layers"],
            "num_attention_heads": heads,
            "num_kv_heads": cfg.get("num_key_value_heads") or heads,
            "head_dim": head_dim,
            "model_dtype": str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            "max_position_embeddings": cfg.get("max_position_embeddings", 131072),
            "surrogate": {
                "hub_ids": {v: f"nvidia/KVzap-{v}-{basename}" for v in VARIANTS},
            },
        },
        basename,
        str(path),
    )


def load_preset(model: str) -> Preset:
    """Resolves ``--model``: a preset name, a preset YAML, a HF model directory or its config.json."""
    if model in list_presets():
        return _from_yaml(CONFIG_DIR / f"{model}.yaml")
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return from_hf_config(path / "config.json")
        raise ConfigError(f"--model {model}: directory has no config.json; pass a HF model directory or a preset")
    if path.is_file():
        if path.suffix in (".yaml", ".yml"):
            return _from_yaml(path)
        return from_hf_config(path)
    raise ConfigError(
        f"--model {model!r}: unknown preset and no such file or directory; known presets: {', '.join(list_presets())}"
    )
