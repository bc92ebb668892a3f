"""kvzap-export: KVzap surrogates and threshold compaction, from checkpoint to deployment."""

__version__ = "0.1.0"
