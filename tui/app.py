"""The `smartgen monitor dashboard` app: a thin Textual shell that polls a feed into the model and draws panels."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.screen import ModalScreen
from textual.widget import Widget
from textual.widgets import Footer, Static

from smartgen.tui import render
from smartgen.tui.feed import Feed, FeedError, ReplayFeed
from smartgen.tui.model import DashboardModel

__all__ = ["DashboardApp"]


class Panel(Widget):
    """Draws `draw(model, width, height)` into its content area; `refresh()` redraws it from the model."""

    def __init__(self, draw: Callable[[DashboardModel, int, int], Text], model: DashboardModel, **kwargs) -> None:
        super().__init__(**kwargs)
        self.draw, self.model = draw, model

    def render(self) -> Text:
        return self.draw(self.model, self.content_size.width, self.content_size.height)


class LayerDetail(ModalScreen[None]):
    """The selected layer at full resolution; up/down move between layers."""

    BINDINGS = [
        Binding("escape,l", "dismiss", "Back"),
        Binding("up", "layer(-1)", "Layer up"),
        Binding("down", "layer(1)", "Layer down"),
    ]

    def __init__(self, model: DashboardModel) -> None:
        super().__init__()
        self.model = model

    def compose(self) -> ComposeResult:
        yield Panel(lambda m, w, h: render.layer_detail(m, w), self.model, id="detail")

    def action_layer(self, step: int) -> None:
        self.model.select_layer(step)
        self.query_one(Panel).refresh()


class DashboardApp(App[None]):
    """Live (or replayed) mask state, lane throughput, requests and peers of one deployment."""

    CSS_PATH = "dashboard.tcss"
    TITLE = "SmartGen monitor"
    BINDINGS = [
        Binding("p", "pause", "Pause"),
        Binding("n", "request(1)", "Next req"),
        Binding("b", "request(-1)", "Prev req"),
        Binding("up", "layer(-1)", "Layer up", show=False),
        Binding("down", "layer(1)", "Layer down", show=False),
        Binding("l", "detail", "Layer detail"),
        Binding("full_stop", "step", "Step", show=False),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, feed: Feed, interval: float = 1.0, paused: bool = False) -> None:
        super().__init__()
        self.feed = feed
        self.interval = interval
        self.model = DashboardModel()
        self.model.paused = paused
        self._polling = asyncio.Lock()

    def compose(self) -> ComposeResult:
        yield Static(id="title")
        yield Static(id="banner")
        yield Panel(lambda m, w, h: render.peers(m), self.model, id="peers")
        with Horizontal(id="top"):
            yield Panel(render.masks, self.model, id="masks")
            yield Panel(lambda m, w, h: render.lanes(m, w), self.model, id="lanes")
        yield Panel(render.requests, self.model, id="requests")
        yield Footer()

    def on_mount(self) -> None:
        self._redraw()
        self.call_later(self.poll)
        self.set_interval(self.interval, self._tick)

    async def _tick(self) -> None:
        if not self.model.paused:
            await self.poll()

    async def poll(self) -> None:
        """Reads one frame from the feed (in a thread: HTTP blocks) into the model; a failure shows the banner."""
        if self._polling.locked():
            return
        async with self._polling:
            try:
                frame = await asyncio.to_thread(self.feed.poll)
            except FeedError as exc:
                self.model.connection_lost(str(exc))
            else:
                self.model.update(frame)
        self._redraw()

    def _redraw(self) -> None:
        model = self.model
        state = "paused" if model.paused else "live"
        if isinstance(self.feed, ReplayFeed):
            state = f"{state} {min(self.feed.position, len(self.feed.frames))}/{len(self.feed.frames)}"
            state += " (end)" if self.feed.done else ""
        self.query_one("#title", Static).update(f"SmartGen monitor  {self.feed.label}  [{state}]")
        banner = self.query_one("#banner", Static)
        if model.error is not None:
            lost = time.monotonic() - (model.lost_since or time.monotonic())
            banner.update(f"connection lost {lost:.0f}s ago: {model.error}; reconnecting every {self.interval:g}s")
        banner.set_class(model.error is not None, "lost")
        for panel in self.query(Panel):
            panel.refresh()

    # -- key bindings (the footer lists them) ----------------------------------------------
    def action_pause(self) -> None:
        self.model.paused = not self.model.paused
        self._redraw()

    async def action_step(self) -> None:
        """One frame forward while paused (replays)."""
        await self.poll()

    def action_request(self, step: int) -> None:
        self.model.select(step)
        self._redraw()

    def action_layer(self, step: int) -> None:
        self.model.select_layer(step)
        self._redraw()

    def action_detail(self) -> None:
        self.push_screen(LayerDetail(self.model))
