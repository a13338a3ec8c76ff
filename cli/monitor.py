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
        list[str] | None,
        option(
            PANEL_SOURCE,
            "A decode node's HTTP address (its /status), e.g. http://127.0.0.1:8000 (the default); repeat to watch "
            "several at once: a strip lists them all, s or 1-9 switch the panels between them.",
        ),
    ] = None,
    cluster: Annotated[
        Path | None,
        option(
            PANEL_SOURCE,
            "Watch every node of a running `smartgen cluster` from its run folder (its cluster.json): each decode "
            "node, and the prefill nodes' push rates.",
        ),
    ] = None,
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

    if replay is not None and (decode or cluster):
        fail("--replay plays a recording: give it without --decode or --cluster")

    if replay is not None:
        try:
            feed: HttpFeed | ReplayFeed = ReplayFeed(replay)
        except (OSError, ValueError) as exc:
            fail(f"cannot replay {replay}: {exc}")
        DashboardApp(feed, interval=interval, paused=paused).run()
        return
    nodes, prefill = _nodes(decode, cluster, list(prefill or []))
    if record is not None and len(nodes) > 1:
        fail(f"--record writes one decode node's frames; {len(nodes)} are watched (give one --decode)")
    try:
        out = record.open("w") if record is not None else None
    except OSError as exc:
        fail(f"cannot record to {record}: {exc}")
    try:
        feeds = [HttpFeed(url, prefill, record=out, name=name) for name, url in nodes]
    except ValueError as exc:
        fail(str(exc))
    try:
        DashboardApp(feeds, interval=interval, paused=paused).run()
    finally:
        if out is not None:
            out.close()


def _nodes(
    decode: list[str] | None, cluster: Path | None, prefill: list[str]
) -> tuple[list[tuple[str, str]], list[str]]:
    """(name, decode URL) of each decode node to watch, and the prefill status URLs: from --cluster's cluster.json
    (its prefill nodes added to --prefill), else --decode (default http://127.0.0.1:8000)."""
    if cluster is None:
        return [("", url) for url in decode or ["http://127.0.0.1:8000"]], prefill
    if decode:
        fail("--cluster names the decode nodes: give it without --decode")
    from smartgen.apps.scale_out import read_manifest

    try:
        manifest = read_manifest(cluster)
    except ValueError as exc:
        fail(str(exc))
    urls = list(manifest["decode"])
    names = list(manifest.get("decode_names") or [f"decode{i}" for i in range(len(urls))])
    named = [(f"{name} {url.split('://')[-1]}", url) for name, url in zip(names, urls)]
    return named, prefill + list(manifest.get("prefill_status") or [])
