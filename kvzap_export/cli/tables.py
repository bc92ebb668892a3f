"""Printing rich tables without ever cutting a cell: identifiers (presets, paths) must stay whole."""

from __future__ import annotations


def print_whole(table, stderr: bool = False) -> None:
    """Prints ``table`` at its natural width when the terminal (or a pipe's 80 columns) is narrower: rich would
    otherwise shrink columns and cut their text with an ellipsis. A narrow terminal then wraps the lines itself."""
    from rich.console import Console
    from rich.measure import Measurement

    console = Console(stderr=stderr)
    needed = Measurement.get(console, console.options.update_width(1 << 16), table).maximum
    if needed > console.width:
        console = Console(stderr=stderr, width=needed)
    console.print(table)
