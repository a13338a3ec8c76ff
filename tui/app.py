"""The `smartgen monitor dashboard` app: a thin Textual shell that polls feeds into models and draws panels.

Several feeds (one per decode node of a scaled-out deployment) are polled together, each into its own model; the
nodes strip lists them all, and the panels show the selected one (s or 1-9 switch).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

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
    """Draws `draw(model, width, height)` into its content area; `refresh()` redraws it from the model `source()`
    returns (the selected node's, which a key may change)."""

    def __init__(
        self, draw: Callable[[DashboardModel, int, int], Text], source: Callable[[], DashboardModel], **kwargs
    ) -> None:
        super().__init__(**kwargs)
        self.draw, self.source = draw, source

    def render(self) -> Text:
        return self.draw(self.source(), self.content_size.width, self.content_size.height)


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
        yield Panel(lambda m, w, h: render.layer_detail(m, w), lambda: self.model, id="detail")

    def action_layer(self, step: int) -> None:
        self.model.select_layer(step)
        self.query_one(Panel).refresh()


class DashboardApp(App[None]):
    """Live (or replayed) mask state, lane throughput, requests and peers of one deployment (one decode node's view
    at a time when several feeds are given)."""

    CSS_PATH = "dashboard.tcss"
    TITLE = "SmartGen monitor"
    BINDINGS = [
        Binding("p", "pause", "Pause"),
        Binding("n", "request(1)", "Next req"),
        Binding("b", "request(-1)", "Prev req"),
        Binding("up", "layer(-1)", "Layer up", show=False),
        Binding("down", "layer(1)", "Layer down", show=False),
        Binding("l", "detail", "Layer detail"),
        Binding("s", "node(1)", "Switch node"),
        *(Binding(str(i), f"pick({i - 1})", f"Node {i}", show=False) for i in range(1, 10)),
        Binding("full_stop", "step", "Step", show=False),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, feed: Feed | Sequence[Feed], interval: float = 1.0, paused: bool = False) -> None:
        super().__init__()
        self.feeds: list[Feed] = list(feed) if isinstance(feed, Sequence) else [feed]
        if not self.feeds:
            raise ValueError("the dashboard needs a feed")
        self.current = 0  # the feed the panels show
        self.interval = interval
        self.models = [DashboardModel() for _ in self.feeds]
        self.paused = paused
        self._polling = asyncio.Lock()

    @property
    def feed(self) -> Feed:
        """The selected node's feed."""
        return self.feeds[self.current]

    @property
    def model(self) -> DashboardModel:
        """The selected node's model."""
        return self.models[self.current]

    @property
    def paused(self) -> bool:
        return self.models[0].paused

    @paused.setter
    def paused(self, value: bool) -> None:
        for model in self.models:
            model.paused = value

    def compose(self) -> ComposeResult:
        yield Static(id="title")
        yield Static(id="banner")
        nodes = Panel(lambda m, w, h: render.nodes(self._node_rows(), w), lambda: self.model, id="nodes")
        nodes.display = len(self.feeds) > 1
        yield nodes
        yield Panel(lambda m, w, h: render.peers(m), lambda: self.model, id="peers")
        with Horizontal(id="top"):
            yield Panel(render.masks, lambda: self.model, id="masks")
            yield Panel(lambda m, w, h: render.lanes(m, w), lambda: self.model, id="lanes")
        yield Panel(render.requests, lambda: self.model, id="requests")
        yield Footer()

    def _node_rows(self) -> list[render.NodeRow]:
        return [
            render.NodeRow(getattr(feed, "name", "") or f"node {i + 1}", model, i == self.current)
            for i, (feed, model) in enumerate(zip(self.feeds, self.models))
        ]

    def on_mount(self) -> None:
        self._redraw()
        self.call_later(self.poll)
        self.set_interval(self.interval, self._tick)

    async def _tick(self) -> None:
        if not self.paused:
            await self.poll()

    async def poll(self) -> None:
        """Reads one frame from every feed at once (threads: HTTP blocks) into its model; a failure marks that node
        lost (the banner, when it is the one shown)."""
        if self._polling.locked():
            return
        async with self._polling:
            await asyncio.gather(*(self._poll_one(feed, model) for feed, model in zip(self.feeds, self.models)))
        self._redraw()

    @staticmethod
    async def _poll_one(feed: Feed, model: DashboardModel) -> None:
        try:
            frame = await asyncio.to_thread(feed.poll)
        except FeedError as exc:
            model.connection_lost(str(exc))
        else:
            model.update(frame)

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
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Node switching only where there are several nodes (else hidden from the footer)."""
        if action in ("node", "pick"):
            return len(self.feeds) > 1
        return True

    def action_pause(self) -> None:
        self.paused = not self.paused
        self._redraw()

    def action_node(self, step: int) -> None:
        """Shows the next (`step` 1) or previous (-1) node, wrapping."""
        self.action_pick((self.current + step) % len(self.feeds))

    def action_pick(self, index: int) -> None:
        """Shows node `index` (0-based), where there is one."""
        if 0 <= index < len(self.feeds):
            self.current = index
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
