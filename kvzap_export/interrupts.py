"""Ctrl-C that no library can lose.

Python turns SIGINT into a KeyboardInterrupt wherever the main thread happens to be. Inside some libraries'
code that exception can be caught and turned into an ordinary error (torch's exporter tries another capture
strategy when one fails; a half-finished import leaves an AttributeError behind), and the run goes on. While
``remembered()`` is active, the SIGINT handler also records the interrupt, so that ``check()`` (called at every
progress step of a long command) raises it again and ``interrupted()`` tells the CLI that an error that followed
it is the interrupt's doing.
"""

from __future__ import annotations

import contextlib
import signal
import threading

_seen = threading.Event()


@contextlib.contextmanager
def remembered():
    """Records SIGINT for ``check()`` / ``interrupted()`` while active (main thread only, and not where SIGINT is
    ignored; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield  # not the main thread, or a process told to ignore Ctrl-C (a background job): left as it is
        return

    def handler(_signum, _frame):
        _seen.set()
        raise KeyboardInterrupt

    _seen.clear()
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _seen.clear()


def interrupted() -> bool:
    return _seen.is_set()


def check() -> None:
    """Raises KeyboardInterrupt if an interrupt arrived (even one a library caught)."""
    if _seen.is_set():
        raise KeyboardInterrupt
