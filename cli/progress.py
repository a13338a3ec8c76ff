"""The progress bar of the long commands (`bench`, `demo`, `eval`, `profile`): one look, with elapsed time and ETA."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # rich loads only when a command runs, so --help stays fast
    from rich.console import Console
    from rich.progress import Progress

__all__ = ["progress_bar"]


def progress_bar(console: Console, what: str = "{task.description}", disable: bool = False) -> Progress:
    """A transient bar on `console`: a spinner (alone while a task has no total), `what` (a rich format of the
    task), the bar, done/total, elapsed, ETA. Use it as a context manager; `disable` draws nothing."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (SpinnerColumn(), TextColumn(what), BarColumn(), MofNCompleteColumn())
    times = (TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
    return Progress(*columns, *times, console=console, transient=True, disable=disable)
