"""KVzap surrogates: the kvpress-format module and its loader."""

from kvzap_export.surrogate.loader import load_surrogate, resolve_weights
from kvzap_export.surrogate.model import Surrogate, SurrogateConfig

__all__ = ["Surrogate", "SurrogateConfig", "load_surrogate", "resolve_weights"]
