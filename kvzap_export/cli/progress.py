"""Rich progress bars for long stages; silent when quiet or when stdout carries JSON."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def progress_bars(enabled: bool) -> Iterator[Callable[[str, int], Callable[[], None]] | None]:
    """Yields ``start(description, total) -> advance()``, or ``None`` when disabled.

    The display starts with the first stage, so a run that fails early prints only its error line.
    """
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("ETA"),
               TimeRemainingColumn())
    bars = Progress(*columns, console=Console(stderr=True), transient=False)

    def start(description: str, total: int) -> Callable[[], None]:
        if not bars.live.is_started:
            bars.start()
        task = bars.add_task(description, total=total)
        return lambda: bars.advance(task)

    try:
        yield start
    finally:
        if bars.live.is_started:
            bars.stop()
