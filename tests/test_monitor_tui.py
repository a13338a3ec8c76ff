"""The dashboard driven by a recorded run: keys do what the footer says, rows follow the replay, screens stay put.

Snapshots are the screen as plain text (tests/snapshots/*.txt), not pytest-textual-snapshot's SVGs: that plugin
pins pytest below 9 and this project runs pytest 9; text diffs also read well in review. Colours are checked
separately (test_mask_cells_are_coloured). Update on purpose with SMARTGEN_UPDATE_SNAPSHOTS=1.
"""

from __future__ import annotations

import asyncio
import io
import os
from pathlib import Path

import pytest
from rich.console import Console

from smartgen.tui import render
from smartgen.tui.app import DashboardApp, LayerDetail
from smartgen.tui.feed import ReplayFeed
from smartgen.tui.model import DashboardModel, downsample

REPLAY = Path(__file__).parent / "data" / "monitor_replay.jsonl"
SNAPSHOTS = Path(__file__).parent / "snapshots"


def _app(**kwargs) -> DashboardApp:
    return DashboardApp(ReplayFeed(REPLAY), interval=60, paused=True, **kwargs)


async def _step(pilot, frames: int) -> None:
    for _ in range(frames):
        await pilot.press("full_stop")
    await pilot.pause()


def _screen_text(app: DashboardApp) -> str:
    """The screen as plain text, what export_screenshot draws into its SVG."""
    console = Console(width=app.size.width, height=app.size.height, file=io.StringIO(), record=True, color_system=None)
    console.print(app.screen._compositor.render_update(full=True))  # the same call export_screenshot makes
    return "\n".join(line.rstrip() for line in console.export_text(styles=False).splitlines()) + "\n"


def _mask_rows(app: DashboardApp) -> list[str]:
    return [row.cells for row in app.model.mask_rows(40)]


def test_the_replay_advances_and_mask_rows_fill_in():
    async def run():
        app = _app()
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            first = app.model.selected_id
            assert first is not None and app.feed.position == 1
            seen = [_mask_rows(app)]
            for _ in range(12):
                await _step(pilot, 1)
                seen.append(_mask_rows(app))
            assert app.model.selected_id == first
            assert seen[0] != seen[-1], "mask rows must change as the replay advances"
            assert sum(r.count("L") for r in seen[-1]) > sum(r.count("L") for r in seen[0])

    asyncio.run(run())


def test_keys_do_what_the_footer_says():
    async def run():
        app = _app()
        async with app.run_test(size=(80, 24)) as pilot:
            await _step(pilot, 30)  # two requests active
            footer = _screen_text(app).splitlines()[-1]
            for key, label in (
                ("p", "Pause"),
                ("n", "Next req"),
                ("b", "Prev req"),
                ("l", "Layer detail"),
                ("q", "Quit"),
            ):
                assert key in footer and label in footer, footer
            ids = [r.request_id for r in app.model.requests()]
            assert len(ids) >= 2
            start = app.model.selected_id
            await pilot.press("n")
            assert app.model.selected_id == ids[(ids.index(start) + 1) % len(ids)]
            await pilot.press("b")
            assert app.model.selected_id == start
            await pilot.press("down")
            assert app.model.selected_layer == 1
            await pilot.press("l")
            assert isinstance(app.screen, LayerDetail)
            await pilot.press("down")
            assert app.model.selected_layer == 2
            await pilot.press("escape")
            assert not isinstance(app.screen, LayerDetail)
            assert app.model.paused
            await pilot.press("p")
            assert not app.model.paused
            await pilot.press("p")
            at = app.feed.position
            await _step(pilot, 1)
            assert app.feed.position == at + 1
            await pilot.press("q")
        assert app.return_code == 0

    asyncio.run(run())


def test_a_lost_connection_shows_a_banner_and_recovers():
    class Flaky:
        label = "flaky"

        def __init__(self) -> None:
            self.replay, self.fail = ReplayFeed(REPLAY), False

        def poll(self):
            from smartgen.tui.feed import FeedError

            if self.fail:
                raise FeedError("http://127.0.0.1:9/status: connection refused")
            return self.replay.poll()

    async def run():
        feed = Flaky()
        app = DashboardApp(feed, interval=60, paused=True)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            feed.fail = True
            await _step(pilot, 1)
            assert "connection lost" in _screen_text(app) and "connection refused" in _screen_text(app)
            assert app.model.requests(), "the last state stays on screen"
            feed.fail = False
            await _step(pilot, 1)
            assert "connection lost" not in _screen_text(app)

    asyncio.run(run())


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
def test_main_screen_snapshot(size):
    async def run() -> str:
        app = _app()
        async with app.run_test(size=size) as pilot:
            await _step(pilot, 29)
            return _screen_text(app)

    text = asyncio.run(run())
    path = SNAPSHOTS / f"dashboard_{size[0]}x{size[1]}.txt"
    if os.environ.get("SMARTGEN_UPDATE_SNAPSHOTS") or not path.exists():
        path.write_text(text)
    assert text == path.read_text(), f"the screen changed; if on purpose, SMARTGEN_UPDATE_SNAPSHOTS=1 ({path})"
    lines = text.splitlines()
    assert len(lines) <= size[1] and max(len(line) for line in lines) <= size[0]
    assert "L00" in text and "fetch_remote" in text and "TTFT" in text  # every panel made it onto the screen


def test_mask_cells_are_coloured():
    model = DashboardModel()
    feed = ReplayFeed(REPLAY)
    for _ in range(30):
        model.update(feed.poll())
    text = render.masks(model, 60, 10)
    styles = {str(span.style) for span in text.spans}
    assert {"green", "red"} <= styles or {"green"} <= styles


def test_downsample_keeps_remote_visible():
    assert downsample("LLLLRLLL", 4) == "LLML"
    assert downsample("....LLLL", 2) == ".L"
    assert downsample("LR", 8) == "LR"


def test_a_finished_request_shows_its_final_on_demand_ratio():
    from smartgen.tui.model import Frame

    model = DashboardModel()
    active = {"request_id": "r1", "state": "decoding", "on_demand_ratio": 0.5, "masks": []}
    model.update(Frame(0.0, {"role": "decode", "requests": [active], "recent": []}))
    done = {"request_id": "r1", "finish_reason": "length", "completion_tokens": 8, "on_demand_ratio": 0.03}
    model.update(Frame(1.0, {"role": "decode", "requests": [], "recent": [done]}))
    (row,) = [r for r in model.requests() if r.request_id == "r1"]
    assert row.on_demand_ratio == 0.03  # the node's final figure, not the last one seen mid-run
    older = {"request_id": "r2", "finish_reason": "length", "completion_tokens": 8}  # a node that did not report it
    model.update(Frame(0.0, {"role": "decode", "requests": [{**active, "request_id": "r2"}], "recent": []}))
    model.update(Frame(1.0, {"role": "decode", "requests": [], "recent": [older]}))
    (row,) = [r for r in model.requests() if r.request_id == "r2"]
    assert row.on_demand_ratio == 0.5
