"""Benchmarks: scoring, compaction, overhead vs attention, end to end. Each figure is a ratio within one run."""
