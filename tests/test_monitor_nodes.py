"""The dashboard watching several decode nodes: a strip lists them all, keys switch the panels, a lost node says so.

The first node replays a recorded run (real /status payloads), the second answers a frame of a node without a live
prefill node (not ready, nothing running), the third refuses every poll. The screen is compared as text with
tests/snapshots/dashboard_nodes_80x24.txt (update on purpose with SMARTGEN_UPDATE_SNAPSHOTS=1).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
from test_monitor_tui import REPLAY, SNAPSHOTS, _screen_text, _step
from typer.testing import CliRunner

from smartgen.cli.app import app as cli_app
from smartgen.tui.app import DashboardApp
from smartgen.tui.feed import FeedError, ReplayFeed
from smartgen.tui.model import Frame

runner = CliRunner()


class Named(ReplayFeed):
    def __init__(self, name: str) -> None:
        super().__init__(REPLAY)
        self.name = name


class NotReady:
    """A decode node whose only prefill node is gone: up, not ready, nothing running."""

    label, name = "http://127.0.0.1:8002", "decode1"

    def poll(self) -> Frame:
        health = {"ready": False, "prefill_nodes": 0, "running": 0, "prefilling": 0, "waiting": 0}
        return Frame(time.time(), {"role": "decode", "health": health, "requests": [], "peers": []})


class Refused:
    label, name = "http://127.0.0.1:9", "decode2"

    def poll(self) -> Frame:
        raise FeedError("http://127.0.0.1:9/status: [Errno 111] Connection refused")


def _app() -> DashboardApp:
    return DashboardApp([Named("decode0"), NotReady(), Refused()], interval=60, paused=True)


def _strip(app: DashboardApp) -> list[str]:
    return [line for line in _screen_text(app).splitlines() if "decode" in line and " done" in line]


def test_the_strip_lists_every_node_and_keys_switch_the_panels():
    async def run():
        app = _app()
        async with app.run_test(size=(100, 30)) as pilot:
            await _step(pilot, 30)  # two requests active on decode0
            strip = _strip(app)
            assert len(strip) == 3, _screen_text(app)
            assert ">1" in strip[0] and "decode0" in strip[0] and "ready" in strip[0] and "run" in strip[0]
            assert "decode1" in strip[1] and "not ready" in strip[1] and "0 run 0 wait" in strip[1]
            assert "decode2" in strip[2] and "lost" in strip[2]
            assert "Switch node" in _screen_text(app).splitlines()[-1]
            ids = {r.request_id for r in app.model.requests()}
            assert ids and "connection lost" not in _screen_text(app)

            await pilot.press("s")  # decode1: its own (empty) request table, its own peers
            assert app.current == 1 and app.feed.name == "decode1"
            assert "no requests yet" in _screen_text(app) and ">2" in _strip(app)[1]
            await pilot.press("s")  # decode2: the banner says why
            assert app.current == 2 and "connection lost" in _screen_text(app)
            assert "Connection refused" in _screen_text(app)
            await pilot.press("1")  # back to decode0, its selection kept
            assert app.current == 0 and {r.request_id for r in app.model.requests()} >= ids
            await pilot.press("9")  # no ninth node: nothing changes
            assert app.current == 0
            at = [feed.position for feed in app.feeds if isinstance(feed, ReplayFeed)]
            await _step(pilot, 1)  # a step polls every node, shown or not
            assert [feed.position for feed in app.feeds if isinstance(feed, ReplayFeed)] == [at[0] + 1]

    asyncio.run(run())


def test_one_node_has_no_strip_and_no_switch_key():
    async def run():
        app = DashboardApp(ReplayFeed(REPLAY), interval=60, paused=True)
        async with app.run_test(size=(100, 30)) as pilot:
            await _step(pilot, 3)
            assert not _strip(app) and "Switch node" not in _screen_text(app)
            await pilot.press("s")
            assert app.current == 0

    asyncio.run(run())


def test_nodes_snapshot():
    async def run() -> str:
        app = _app()
        async with app.run_test(size=(80, 24)) as pilot:
            await _step(pilot, 29)
            return _screen_text(app)

    text = asyncio.run(run())
    path = SNAPSHOTS / "dashboard_nodes_80x24.txt"
    if os.environ.get("SMARTGEN_UPDATE_SNAPSHOTS") or not path.exists():
        path.write_text(text)
    assert text == path.read_text(), f"the screen changed; if on purpose, SMARTGEN_UPDATE_SNAPSHOTS=1 ({path})"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--cluster", "{tmp}"], "no cluster.json in"),
        (["--cluster", "{tmp}", "--decode", "http://127.0.0.1:1"], "give it without --decode"),
        (["--decode", "http://a:1", "--decode", "http://b:1", "--record", "{tmp}/r.jsonl"], "--record writes one"),
        (["--replay", "{tmp}/r.jsonl", "--decode", "http://a:1"], "--replay plays a recording"),
        (["--cluster", "{tmp}/broken"], "lists no decode nodes"),
    ],
)
def test_monitor_mistakes_are_one_line_errors(tmp_path, args, says):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "cluster.json").write_text(json.dumps({"decode": []}))
    result = runner.invoke(cli_app, ["monitor", *[a.replace("{tmp}", str(tmp_path)) for a in args]])
    assert result.exit_code == 2, result.output
    assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
