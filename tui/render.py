"""The dashboard's panels as rich Text, drawn from the model to a given width (pure: the snapshot tests read them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rich.text import Text

from smartgen.tui.model import DashboardModel, LinkUse, PathRate, RequestRow

__all__ = [
    "CELL_STYLES",
    "masks",
    "lanes",
    "requests",
    "peers",
    "nodes",
    "NodeRow",
    "layer_detail",
    "sparkline",
    "rate",
]

# local green, remote red, mixed yellow, padding dim: the colours the legend names
CELL_STYLES = {"L": ("█", "green"), "R": ("█", "red"), "M": ("▓", "yellow"), ".": ("·", "grey42")}
SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(series: list[float], width: int, top: float | None = None) -> str:
    """The newest `width` values as block characters scaled to `top` (default: their maximum)."""
    values = series[-width:] if width > 0 else []
    peak = top if top is not None else max(values, default=0.0)
    chars = [SPARKS[min(7, int(v / peak * 7.999))] if peak > 0 and v > 0 else " " for v in values]
    return " " * (width - len(chars)) + "".join(chars)


def rate(bytes_per_s: float | None) -> str:
    if bytes_per_s is None:
        return "n/a"
    for unit, size in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= size:
            return f"{bytes_per_s / size:.1f} {unit}"
    return f"{bytes_per_s:.0f} B/s"


def _cells(cells: str) -> Text:
    text = Text()
    for char in cells:
        glyph, style = CELL_STYLES.get(char, ("?", "magenta"))
        text.append(glyph, style)
    return text


def masks(model: DashboardModel, width: int, height: int) -> Text:
    """One row per layer of the selected request (a window around the selected layer when they do not fit)."""
    selected = model.selected()
    label = f"{selected.request_id[:8]} ({selected.state})" if selected else "no request"
    text = Text(f"mask {label}\n", style="bold")
    rows = model.mask_rows(max(1, width - 11))
    if not rows:
        text.append("no mask state yet: waiting for a request", style="dim")
        return text
    visible = max(1, height - 2)
    start = min(max(0, model.selected_layer - visible // 2), max(0, len(rows) - visible))
    for row in rows[start : start + visible]:
        marker = ">" if row.layer == model.selected_layer else " "
        total = row.local + row.remote
        share = f"{100 * row.local / total:3.0f}%" if total else "   -"
        text.append(f"{marker}L{row.layer:02d} ", "bold" if marker == ">" else "")
        text.append_text(_cells(row.cells))
        text.append(f" {share}\n")
    text.append("█", "green")
    text.append(" local ")
    text.append("█", "red")
    text.append(" remote ")
    text.append("▓", "yellow")
    text.append(" mixed ")
    text.append("·", "grey42")
    text.append(" padding")
    return text


def _path_line(rate_: PathRate, spark_width: int) -> Text:
    line = Text(f"{rate_.path:<12} ")
    if rate_.current is None:
        line.append(" " * spark_width, "dim")
    else:
        line.append(sparkline(rate_.series, spark_width), "cyan")
    line.append(f" {rate(rate_.current):>10}", "bold" if rate_.current else "dim")
    return line


def _link_line(use: LinkUse, spark_width: int, name_width: int) -> Text:
    current = use.series[-1] if use.series else 0.0
    line = Text(f"{use.name[:name_width]:<{name_width}} ")
    line.append(sparkline(use.series, spark_width, top=1.0), "magenta")
    line.append(f" {100 * current:9.0f}%" if use.up else "      down", "" if use.up else "bold red")
    return line


def lanes(model: DashboardModel, width: int) -> Text:
    """Bytes per second per path over the last minute, then each link's busy share (utilisation)."""
    spark_width = max(4, width - 24)
    text = Text("throughput (last minute)\n", style="bold")
    for rate_ in model.path_rates():
        text.append_text(_path_line(rate_, spark_width))
        text.append("\n")
    uses = model.link_use()
    if uses:
        text.append("link utilisation\n", style="bold")
    for use in uses:
        text.append_text(_link_line(use, spark_width, 12))
        text.append("\n")
    text.rstrip()
    return text


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}ms" if value < 10 else f"{value:.1f}s"


# column name, width, value: all nine fit in 80 columns; narrower terminals lose columns from the right
_COLUMNS = (
    ("request", 8, lambda r: r.request_id[:8]),
    ("prompt", 6, lambda r: "-" if r.prompt_tokens is None else str(r.prompt_tokens)),
    ("scheme", 8, lambda r: r.scheme[:8]),
    ("state", 11, lambda r: r.state[:11]),
    ("TTFT", 6, lambda r: _seconds(r.ttft)),
    ("TTST", 6, lambda r: _seconds(r.ttst)),
    ("TBT", 6, lambda r: _seconds(r.tbt)),
    ("tokens", 6, lambda r: "-" if r.tokens is None else str(r.tokens)),
    ("on-dem", 6, lambda r: "-" if r.on_demand_ratio is None else f"{100 * r.on_demand_ratio:.1f}%"),
)


def requests(model: DashboardModel, width: int, height: int) -> Text:
    """The request table: active requests, then finished ones; the selected one highlighted."""
    columns: list[tuple[str, int, Callable[[RequestRow], str]]] = []
    used = 0
    for column in _COLUMNS:
        if used + column[1] + 1 > width and columns:
            break
        columns.append(column)
        used += column[1] + 1
    text = Text(" ".join(f"{name:>{w}}" if i else f"{name:<{w}}" for i, (name, w, _) in enumerate(columns)), "bold")
    rows: list[RequestRow] = model.requests()
    if not rows:
        text.append("\nno requests yet", style="dim")
    for row in rows[: max(0, height - 1)]:
        cells = [value(row) for _, _, value in columns]
        line = " ".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, ((_, w, _), c) in enumerate(zip(columns, cells)))
        style = "reverse" if row.request_id == model.selected_id else ("" if row.active else "dim")
        text.append("\n")
        text.append(line, style)
    return text


def peers(model: DashboardModel) -> Text:
    """One strip: each node and link, up or down, with its load."""
    text = Text()
    for i, row in enumerate(model.peers()):
        if i:
            text.append("  ")
        text.append("●" if row.up else "○", "green" if row.up else "bold red")
        text.append(f" {row.name}")
        if row.detail:
            text.append(f" {row.detail}", "dim")
    return text


@dataclass(frozen=True, slots=True)
class NodeRow:
    """A decode node in the nodes strip: its name, its model, and whether the panels show it."""

    name: str
    model: DashboardModel
    shown: bool


_NODE_STYLES = {
    "ready": ("●", "green"),
    "not ready": ("●", "yellow"),
    "lost": ("○", "bold red"),
    "waiting": ("○", "dim"),
}


def nodes(rows: list[NodeRow], width: int) -> Text:
    """One line per decode node: the key that shows it, its name, state and requests; the shown one highlighted."""
    text = Text()
    for i, row in enumerate(rows):
        node = row.model.node()
        glyph, style = _NODE_STYLES.get(node.state, ("?", "magenta"))
        load = "" if node.running is None else f"  {node.running} run {node.waiting} wait"
        line = Text(f"{'>' if row.shown else ' '}{i + 1} ", "bold" if row.shown else "")
        line.append(glyph, style)
        line.append(f" {row.name}  ")
        line.append(node.state, style)
        line.append(f"{load}  {node.finished} done", "dim")
        line.truncate(max(1, width))
        if row.shown:
            line.stylize("reverse")
        if i:
            text.append("\n")
        text.append_text(line)
    return text


def layer_detail(model: DashboardModel, width: int) -> Text:
    """The selected layer at full /status resolution, wrapped, with its entry counts."""
    detail = model.layer_detail()
    if detail is None:
        return Text("no layer selected: no mask state for this request", style="dim")
    text = Text(f"layer {detail['layer']} of {(model.selected_id or '')[:8]}\n", style="bold")
    counts = detail["counts"]
    if counts:
        text.append(f"entries: {counts['local']} local, {counts['remote']} remote, {counts['pad']} padding (slot)\n")
    cells = detail["cells"]
    step = max(8, width)
    for start in range(0, len(cells), step):
        text.append_text(_cells(cells[start : start + step]))
        text.append("\n")
    text.append("esc or l: back", style="dim")
    return text
