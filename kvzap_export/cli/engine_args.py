"""``--engine-arg KEY=VALUE`` (``validate --engine``, ``bench --engine``): extra keyword arguments of the serving engine
(``sglang.Engine(**kwargs)``, SGLang's server arguments with underscores), e.g. ``sampling_backend=pytorch`` or
``mem_fraction_static=0.3``. VALUE is read as JSON where it is JSON (numbers, true / false, null, lists), else kept as
the string given. A key the command sets through an option of its own is refused, naming that option."""

from __future__ import annotations

import json
import re

from kvzap_export.errors import ConfigError

KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
HELP = ("an extra argument of the serving engine, KEY=VALUE (sglang.Engine's keyword, e.g. sampling_backend=pytorch, "
        "mem_fraction_static=0.3, cuda_graph_max_bs_decode=16); repeat for more. VALUE is read as JSON where it is JSON "
        "(numbers, true/false), else as a string.")


def _value(raw: str):
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def parse_engine_args(values, reserved: dict[str, str] | None = None) -> dict:
    """``["k=v", ...]`` -> ``{"k": value}``; a malformed, repeated or reserved key (``reserved``: key -> the option that
    sets it) is a one-line ``ConfigError``."""
    out: dict = {}
    for text in values or ():
        key, sep, raw = text.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not KEY.match(key) or not raw.strip():
            raise ConfigError(f"--engine-arg {text!r}: use KEY=VALUE, KEY an sglang.Engine argument (e.g. "
                              "sampling_backend=pytorch)")
        if key in (reserved or {}):
            raise ConfigError(f"--engine-arg {key}: this command sets it through {reserved[key]}; use that instead")
        if key in out:
            raise ConfigError(f"--engine-arg {key}: given twice ({out[key]!r} and {raw.strip()!r}); give it once")
        out[key] = _value(raw.strip())
    return out
