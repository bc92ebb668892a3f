"""One error hierarchy for the whole toolkit.

``KvzapError`` and its subclasses are *user* errors: something the person running the tool can
fix (a bad value, a missing file). The CLI prints them as one line and exits with code 2.
Anything else that escapes is our bug: it keeps its traceback and exits with code 1.
"""

from __future__ import annotations


class KvzapError(Exception):
    """A user-facing error: one line that names the bad value and what to do about it."""

    exit_code = 2
    label = "error"  # the line's prefix on stderr


class ConfigError(KvzapError):
    """A preset, a model config or a command-line value is wrong."""


class WeightsError(KvzapError):
    """Surrogate weights are missing, malformed or do not match the model."""


class BundleError(KvzapError):
    """A bundle cannot be written, read or trusted."""


class InputError(KvzapError):
    """Tensors handed to a public op have the wrong rank, dtype or sizes."""


class MissingDependencyError(KvzapError):
    """An optional dependency is needed for this feature and is not installed."""


class ValidationFailedError(KvzapError):
    """A check failed: the bundle does not match the reference (exit 1, like a failed test)."""

    exit_code = 1


class ValidationIncompleteError(KvzapError):
    """Nothing failed but not every check ran (exit 3): never reported as a pass."""

    exit_code = 3
    label = "incomplete"


class BenchFailedError(KvzapError):
    """A benchmark suite raised; the others' figures were still written."""

    exit_code = 1
