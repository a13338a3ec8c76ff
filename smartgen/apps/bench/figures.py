"""A benchmark's PNG figures: CTL and step gaps per point, TTST and TBT bars, and the bandwidth sweep; every
timing as the streaming client saw it (the summaries' headline figures)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from smartgen.apps.bench.config import Point
from smartgen.apps.bench.runner import BenchResult
from smartgen.apps.bench.stats import Summary

__all__ = ["figures", "bandwidth_series", "goodput_figure", "goodput_series", "link_panels"]


def figures(result: BenchResult, summaries: list[Summary], out: Path) -> list[Path]:
    """Draws ctl.png, steps.png, ttst_tbt.png, link.png (each scheme's link use by what crossed, over its first
    measured round) and, with several link rates, bandwidth.png under `out`; none
    without matplotlib (smartgen[plot]). Returns the files written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # figures are optional (smartgen[plot]); JSON and CSV hold every number
        return []
    written = []
    schemes = result.config.all_schemes
    points = result.points
    # CTL per scheme (the paper's Figure 9), one panel per point
    fig, axes = plt.subplots(len(points), 1, figsize=(7, 3.2 * len(points)), squeeze=False)
    for index, ax in enumerate(axes[:, 0]):
        for s in summaries:
            if s.point == index and s.ctl:
                ax.plot(range(len(s.ctl)), s.ctl, label=s.scheme)
        bound = _bound_of(summaries, index)
        if bound:
            ax.plot(range(len(bound)), bound, "k--", linewidth=1, label="bound (lossless, perfect prediction)")
        ax.set_title(points[index].label(result.config.link_mode), fontsize=8)
        ax.set_xlabel("output token (text chunk at the client)")
        ax.set_ylabel("mean arrival at the client (s)")
        if ax.lines:  # a point whose requests all failed has nothing to name
            ax.legend(fontsize=6)
    fig.tight_layout()
    written.append(_save(fig, out / "ctl.png", plt))
    # where TBT goes: the time between consecutive tokens, per output token (a step that waited for the link
    # stands out above full transfer's all-local steps)
    fig, axes = plt.subplots(len(points), 1, figsize=(7, 3.2 * len(points)), squeeze=False)
    for index, ax in enumerate(axes[:, 0]):
        for s in summaries:
            if s.point == index and len(s.ctl) > 2:
                ax.plot(range(2, len(s.ctl)), _gaps_ms(s.ctl), label=s.scheme)
        bound = _bound_of(summaries, index)
        if len(bound) > 2:
            ax.plot(
                range(2, len(bound)), _gaps_ms(bound), "k--", linewidth=1, label="bound (lossless, perfect prediction)"
            )
        ax.set_title(points[index].label(result.config.link_mode), fontsize=8)
        ax.set_xlabel("output token (2 = the second token after TTST)")
        ax.set_ylabel("time since the previous token (ms)")
        ax.set_yscale("log")
        if ax.lines:  # a point whose requests all failed has nothing to name
            ax.legend(fontsize=6)
    fig.tight_layout()
    written.append(_save(fig, out / "steps.png", plt))
    # TTST and TBT bars per scheme and batch size
    batches = sorted({p.batch for p in points})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(batches), 1)
    for b_index, batch in enumerate(batches):
        for m_index, metric in enumerate(("ttst", "tbt")):
            heights = []
            for scheme in schemes:
                values = [
                    getattr(s, metric)["mean"]
                    for s in summaries
                    if s.scheme == scheme and points[s.point].batch == batch and getattr(s, metric)["mean"] is not None
                ]
                heights.append(sum(values) / len(values) if values else 0.0)
            xs = [i + b_index * width for i in range(len(schemes))]
            axes[m_index].bar(xs, heights, width, label=f"batch {batch}")
            # the least TTST the link allows, with step one's selection sent first, and the TBT floor
            marked = {
                "ttst": (
                    ("ttst_bound", "black", "bound"),
                    ("ttst_bound_selection", "red", "bound1: step one's selection too"),
                ),
                "tbt": (("tbt_floor", "black", "TBT fl: every token at its CTL bound"),),
            }
            for attr, color, label in marked[metric]:
                marks = [
                    (x, getattr(s, attr))
                    for x, scheme in zip(xs, schemes)
                    for s in summaries
                    if s.scheme == scheme and points[s.point].batch == batch and getattr(s, attr) is not None
                ]
                if marks:
                    axes[m_index].scatter(
                        [x for x, _ in marks],
                        [b for _, b in marks],
                        marker="_",
                        s=200,
                        color=color,
                        label=label if b_index == 0 else None,
                    )
    for ax, metric in zip(axes, ("TTST (s)", "mean TBT (s)")):
        ax.set_xticks([i + width * (len(batches) - 1) / 2 for i in range(len(schemes))])
        ax.set_xticklabels(schemes, rotation=45, ha="right", fontsize=7)
        ax.set_ylabel(metric)
        ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(_save(fig, out / "ttst_tbt.png", plt))
    # the bandwidth sweep: TTST per scheme over link rate, a panel per setting of the other sweeps
    series = bandwidth_series(result, summaries)
    if any(len(line) > 1 for panel in series.values() for line in panel.values()):
        fig, axes = plt.subplots(len(series), 1, figsize=(7, 4 * len(series)), squeeze=False)
        for ax, (title, lines) in zip(axes[:, 0], series.items()):
            for scheme, pairs in lines.items():
                ax.plot([p[0] for p in pairs], [p[1] for p in pairs], marker="o", label=scheme)
            ax.set_title(title, fontsize=8)
            ax.set_xscale("log")
            ax.set_xlabel("link (Gbit/s)")
            ax.set_ylabel("TTST (s)")
            ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(_save(fig, out / "bandwidth.png", plt))
    panels = link_panels(result)
    if panels:
        fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.4 * len(panels)), squeeze=False)
        for ax, (title, shares) in zip(axes[:, 0], panels):
            seconds = range(len(next(iter(shares.values()))))
            ax.stackplot(seconds, *shares.values(), labels=list(shares), step="post")
            ax.set_title(title, fontsize=8)
            ax.set_xlabel("second of the round")
            ax.set_ylabel("% of the link")
            ax.set_ylim(0, 110)
            ax.legend(fontsize=6, loc="upper right", ncol=3)
        fig.tight_layout()
        written.append(_save(fig, out / "link.png", plt))
    return written


def link_panels(result: BenchResult) -> list[tuple[str, dict[str, list[float]]]]:
    """link.png's data: for each point and scheme, its first measured round's link use, each tag's bytes a second
    as a percentage of the point's link rate (busiest tag first); none for rounds without a timeline."""
    panels = []
    for group in result.groups:
        if group.warmup or not group.link_timeline or group.rep != result.config.warmup:
            continue
        rate = result.regimes[group.point].link_gbps * 1e9 / 8 if group.point < len(result.regimes) else 0.0
        if rate <= 0:
            continue
        tags = sorted(group.link_timeline, key=lambda tag: -sum(group.link_timeline[tag]))
        shares = {tag: [100 * b / rate for b in group.link_timeline[tag]] for tag in tags}
        label = result.points[group.point].label(result.config.link_mode)
        panels.append((f"{group.scheme}: {label}", shares))
    return panels


def goodput_series(result: BenchResult) -> dict[int, dict[str, list[tuple[float, float]]]]:
    """goodput.png's data: {point: {scheme: [(offered req/s, goodput req/s), ...] by rate}}."""
    series: dict[int, dict[str, list[tuple[float, float]]]] = {}
    for run in (r for r in result.loads if r.offered_rate is not None):
        series.setdefault(run.point, {}).setdefault(run.label, []).append((run.offered_rate, run.goodput))
    for lines in series.values():
        for line in lines.values():
            line.sort()
    return series


def goodput_figure(result: BenchResult, out: Path) -> list[Path]:
    """goodput.png under `out` when a load or trace run swept --load-rate: goodput against offered rate per scheme,
    a panel per point, the ideal (every request within its SLOs) dashed. None without matplotlib or a sweep."""
    series = goodput_series(result)
    if not any(len(line) > 1 for lines in series.values() for line in lines.values()):
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # figures are optional (smartgen[plot]); load.csv holds every number
        return []
    fig, axes = plt.subplots(len(series), 1, figsize=(7, 4 * len(series)), squeeze=False)
    for ax, (point, lines) in zip(axes[:, 0], series.items()):
        rates = sorted({rate for line in lines.values() for rate, _ in line})
        ax.plot(rates, rates, "k--", linewidth=1, label="offered (every request within its SLOs)")
        for scheme, pairs in lines.items():
            ax.plot([p[0] for p in pairs], [p[1] for p in pairs], marker="o", label=scheme)
        slos = next(r.slos for r in result.loads if r.point == point)
        ax.set_title(f"{result.points[point].label(result.config.link_mode)}\nSLOs: {slos.words()}", fontsize=8)
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel("goodput (requests/s within SLOs)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return [_save(fig, out / "goodput.png", plt)]


_SWEEP_WORDS: dict[str, Callable[[Any], str]] = {
    "batch": lambda v: f"batch {v}",
    "length": lambda v: f"{v} tokens",
    "blocks": lambda v: f"M={v}",
    "budget": lambda v: f"budget {v:g}",
    "speculative_ratio": lambda v: f"spec {v:g}",
    "prefill_nodes": lambda v: f"{v} prefill node{'s' * (v > 1)}",
    "prefix_hit": lambda v: "prefix caches off" if v is None else f"prefix hit {v:.0%}",
}


def bandwidth_series(result: BenchResult, summaries: list[Summary]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """bandwidth.png's data: {panel title: {scheme: [(link Gbit/s, mean TTST s), ...] by rate}}.

    One panel per setting of every sweep but the link's (batch, length, M, ...), so a scheme's line never joins
    points of two batch sizes; titles name the sweeps that vary ("" when only the link does). Panels and schemes
    keep the order of the points and summaries.
    """
    rest = [replace(p, link=0.0) for p in result.points]  # a point without its link: which panel it is in
    varying = [f.name for f in fields(Point) if f.name != "link" and len({getattr(r, f.name) for r in rest}) > 1]
    panels: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for s in summaries:
        if s.ttst["mean"] is None:
            continue
        title = ", ".join(_SWEEP_WORDS[name](getattr(rest[s.point], name)) for name in varying)
        line = panels.setdefault(title, {}).setdefault(s.scheme, [])
        line.append((result.regimes[s.point].link_gbps, s.ttst["mean"]))
    for lines in panels.values():
        for line in lines.values():
            line.sort()
    return panels


def _gaps_ms(arrivals: list[float]) -> list[float]:
    """Milliseconds between consecutive arrivals from the second token on (TBT's gaps)."""
    return [1000.0 * (b - a) for a, b in zip(arrivals[1:], arrivals[2:])]


def _bound_of(summaries: list[Summary], point: int) -> list[float]:
    """The CTL bound drawn for a point: smartgen's, else the first budgeted scheme's that has one."""
    candidates = [s for s in summaries if s.point == point and s.ctl_bound and s.scheme not in ("full", "quant2")]
    preferred = [s for s in candidates if s.scheme == "smartgen"] or candidates
    return preferred[0].ctl_bound if preferred else []


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
