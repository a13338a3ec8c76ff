"""`smartgen monitor [dashboard]`: the live dashboard of a deployment's mask state, lane throughput and requests."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated

import typer

from .errors import fail
from .options import option

PANEL_SOURCE = "What to watch"


class View(str, enum.Enum):
    dashboard = "dashboard"


def monitor(
    view: Annotated[
        View, typer.Argument(help="What to open: the dashboard (the only view so far, and the default).")
    ] = View.dashboard,
    decode: Annotated[
        str | None, option(PANEL_SOURCE, "The decode node's HTTP address (its /status), e.g. http://127.0.0.1:8000.")
    ] = "http://127.0.0.1:8000",
    prefill: Annotated[
        list[str] | None,
        option(
            PANEL_SOURCE,
            "A prefill node's status address (`serve --status`); repeat for several. Needed for push rates "
            "and link utilisation.",
        ),
    ] = None,
    replay: Annotated[
        Path | None,
        option(
            PANEL_SOURCE,
            "Replay a recording (`serve --record`, `monitor dashboard --record`) instead of polling nodes.",
        ),
    ] = None,
    record: Annotated[
        Path | None, typer.Option(help="Also write every polled frame to this file (JSON lines) for --replay.")
    ] = None,
    interval: Annotated[float, typer.Option(min=0.05, help="Seconds between polls (or replayed frames).")] = 1.0,
    paused: Annotated[bool, typer.Option(help="Start paused (replays: step with '.').")] = False,
) -> None:
    """Open the dashboard: per-layer mask rows, lane throughput, requests and peers; keys in the footer."""
    from smartgen.tui.app import DashboardApp
    from smartgen.tui.feed import HttpFeed, ReplayFeed

    if replay is not None:
        try:
            feed: HttpFeed | ReplayFeed = ReplayFeed(replay)
        except (OSError, ValueError) as exc:
            fail(f"cannot replay {replay}: {exc}")
        DashboardApp(feed, interval=interval, paused=paused).run()
        return
    try:
        out = record.open("w") if record is not None else None
    except OSError as exc:
        fail(f"cannot record to {record}: {exc}")
    try:
        feed = HttpFeed(decode, list(prefill or []), record=out)
    except ValueError as exc:
        fail(str(exc))
    try:
        DashboardApp(feed, interval=interval, paused=paused).run()
    finally:
        if out is not None:
            out.close()
