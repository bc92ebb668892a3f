"""The plugin's settings: ``KVZAP_*`` numbers read from the environment, the SGLang version check, and the warning
evict mode gives where the bundle's own measurement says it frees nothing (``plugin.py`` applies them)."""

from __future__ import annotations

import os

from kvzap_export.errors import ConfigError


def evict_frees_nothing(bundle, threshold=None) -> str | None:
    """A warning when the bundle's own measurement says evict mode cannot free memory on this model.

    Evict mode keeps one KV length per request (SGLang's slots hold every layer and head of a token), so a request
    holds what its busiest (layer, head) keeps. The bundle's model level measured, on its validation prompts, the
    entries that one length per request would hold (``kv_cache_layouts_from_counts.uniform``); where that is
    every entry, evict mode pays for scoring and masked decode and frees nothing."""
    import json
    from pathlib import Path

    try:
        report = json.loads((Path(bundle) / "report" / "parity.json").read_text())
        model = next(c for c in report["checks"] if c["name"] == "model:compacted_vs_kvpress")
        layouts = model["detail"]["kv_cache_layouts_from_counts"]
        uniform, ragged = layouts["uniform"]["freed_fraction"], layouts["ragged"]["freed_fraction"]
    except (OSError, ValueError, KeyError, StopIteration, TypeError):
        return None  # no measurement in this bundle: nothing to say
    if uniform > 0.01:
        return None
    at = "" if threshold is None else f" (measured at the bundle's threshold; this server uses τ = {threshold})"
    return (f"KVzap evict mode frees nothing on this model: on the bundle's validation prompts one KV length per "
            f"request freed {uniform:.1%} of the entries where per-head storage freed {ragged:.1%}{at}; every request "
            "keeps what its busiest head keeps. Use KVZAP_MODE=ragged to free memory (evict mode still gives "
            "kvpress's tokens)")


def check_sglang_version() -> None:
    """The glue names SGLang internals of one release: any other stops the launch (one line, both versions)."""
    import importlib.metadata

    from kvzap_export.integrations.sglang.api import SGLANG_VERSION

    try:
        found = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return  # not an SGLang process: importing SGLang later says how to install it
    if found != SGLANG_VERSION:
        raise ConfigError(f"KVzap's SGLang glue is written against sglang {SGLANG_VERSION}, this process has sglang "
                          f"{found}; install sglang=={SGLANG_VERSION} (or a kvzap-export release for {found})")


def _number_from_env(name: str, key: str, valid, hint: str) -> dict:
    """``{key: float($name)}`` when the variable is set, ``{}`` when not; a value that is no number or fails ``valid``
    is a one-line error saying what to use (``hint``)."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return {}
    try:
        value = float(raw)
    except ValueError:
        value = None
    if value is None or not valid(value):
        raise ConfigError(f"{name}={raw!r}: use {hint}")
    return {key: value}


def threshold_from_env() -> dict:
    return _number_from_env("KVZAP_THRESHOLD", "threshold", lambda v: True, "a number such as -4 (a log-score threshold)")


def pruned_fraction_from_env() -> dict:
    return _number_from_env("KVZAP_PRUNED_FRACTION", "pruned_fraction", lambda v: 0.0 < v < 1.0,
                            "a fraction such as 0.7 (strictly between 0 and 1)")
