"""kvzap_export.interrupts: a Ctrl-C that a library catches is not lost."""

from __future__ import annotations

import os
import signal

import pytest

from kvzap_export import interrupts


def _swallowing_library():
    """What torch's exporter can do with an interrupt: catch it and go on another way."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the handler runs at a bytecode boundary
            pass
    except BaseException:  # noqa: BLE001  (the point: a library that swallows it)
        return "went on"
    return "never interrupted"


def test_an_interrupt_a_library_swallowed_is_raised_at_the_next_check():
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # CI may run with SIGINT ignored
    try:
        _remembered_and_restored()
    finally:
        signal.signal(signal.SIGINT, before)


def test_where_sigint_is_ignored_it_stays_ignored():
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupts.remembered():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def _remembered_and_restored():
    with interrupts.remembered():
        assert _swallowing_library() == "went on"
        assert interrupts.interrupted()
        with pytest.raises(KeyboardInterrupt):
            interrupts.check()
    assert not interrupts.interrupted()  # cleared, and the previous handler is back
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_pipelines_progress_steps_check_for_it(monkeypatch):
    from kvzap_export.pipeline import _stops_on_interrupt

    steps = []
    progress = _stops_on_interrupt(lambda _d, _t: lambda: steps.append(1))
    advance = progress("export", 2)
    advance()
    monkeypatch.setattr(interrupts, "_seen", type("Seen", (), {"is_set": lambda self: True})())
    with pytest.raises(KeyboardInterrupt):
        advance()
    assert steps == [1]
