"""A benchmark's output folder: results.json (everything), summary.csv, and PNG figures when matplotlib is there."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from smartgen.apps.bench.runner import BenchResult
from smartgen.apps.bench.stats import Summary

__all__ = ["write_outputs", "CSV_COLUMNS"]

CSV_COLUMNS = (
    "point",
    "lane",
    "batch",
    "length",
    "link_gbps",
    "stall_ratio",
    "decode_ratio",
    "blocks",
    "budget",
    "speculative_ratio",
    "prefill_nodes",
    "prefix_hit",
    "scheme",
    "requests",
    "failed",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "ttst_mean_s",
    "ttst_p50_s",
    "ttst_p99_s",
    "tbt_mean_s",
    "tbt_p50_s",
    "tbt_p99_s",
    "ttst_speedup_vs_full",
    "ttft_vs_full",
    "tbt_vs_full",
    "ttst_bound_s",
    "ttst_bound_selection_s",
    "tbt_floor_s",
    "on_demand_ratio",
    "first_step_coverage",
    "first_step_wait_s",
    "wait_per_step_s",
    "full_bytes",
    "proactive_bytes",
    "on_demand_bytes",
    "speculative_bytes",
    "metadata_bytes",
    "descriptors",
    "posting_s",
    "link_utilisation",
    "accuracy",
    "accuracy_vs_full",
)


def _row(result: BenchResult, s: Summary) -> dict[str, Any]:
    point, regime = result.points[s.point], result.regimes[s.point]
    paths = s.bytes_per_request
    return {
        "point": s.point,
        "lane": result.config.lane,
        "batch": point.batch,
        "length": point.length,
        "link_gbps": regime.link_gbps,
        "stall_ratio": regime.stall_ratio,
        "decode_ratio": regime.decode_ratio,
        "blocks": point.blocks,
        "budget": point.budget,
        "speculative_ratio": point.speculative_ratio,
        "prefill_nodes": point.prefill_nodes,
        "prefix_hit": point.prefix_hit,
        "scheme": s.scheme,
        "requests": s.requests,
        "failed": s.failed,
        **{f"{m}_{k}_s": getattr(s, m)[k] for m in ("ttft", "ttst", "tbt") for k in ("mean", "p50", "p99")},
        "ttst_speedup_vs_full": s.vs_full.get("ttst_speedup"),
        "ttft_vs_full": s.vs_full.get("ttft"),
        "tbt_vs_full": s.vs_full.get("tbt"),
        "ttst_bound_s": s.ttst_bound,
        "ttst_bound_selection_s": s.ttst_bound_selection,
        "tbt_floor_s": s.tbt_floor,
        "on_demand_ratio": s.on_demand_ratio,
        "first_step_coverage": s.first_step_coverage,
        "first_step_wait_s": s.first_step_wait,
        "wait_per_step_s": s.wait_per_step,
        **{f"{p}_bytes": paths.get(p, 0.0) for p in ("full", "proactive", "on_demand", "speculative", "metadata")},
        "descriptors": s.descriptors_per_request,
        "posting_s": s.posting_s_per_request,
        "link_utilisation": s.link_utilisation,
        "accuracy": s.accuracy,
        "accuracy_vs_full": s.vs_full.get("accuracy"),
    }


def write_outputs(result: BenchResult, summaries: list[Summary], out: Path) -> list[Path]:
    """Writes everything under `out` (created); returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    data = {**result.to_json(), "summaries": [asdict(s) for s in summaries]}
    path = out / "results.json"
    path.write_text(json.dumps(data, indent=1))
    written.append(path)
    path = out / "summary.csv"
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for s in summaries:
            writer.writerow(_row(result, s))
    written.append(path)
    if result.loads:
        written.append(_load_csv(result, out / "load.csv"))
        return written  # the figures draw rounds; a load run has none
    written.extend(_figures(result, summaries, out))
    return written


LOAD_COLUMNS = (
    "point",
    "length",
    "link_gbps",
    "scheme",
    "offered_rate",
    "arrivals",
    "completed",
    "failed",
    "met_slo",
    "goodput",
    "throughput",
    "ttft_p50_s",
    "ttft_p99_s",
    "tbt_p50_s",
    "tbt_p99_s",
)


def _load_csv(result: BenchResult, path: Path) -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=LOAD_COLUMNS)
        writer.writeheader()
        for run in result.loads:
            ttft, tbt = run.percentiles("ttft"), run.percentiles("tbt")
            writer.writerow(
                {
                    "point": run.point,
                    "length": result.points[run.point].length,
                    "link_gbps": result.regimes[run.point].link_gbps,
                    "scheme": run.scheme,
                    "offered_rate": run.offered_rate,
                    "arrivals": run.arrivals,
                    "completed": run.completed,
                    "failed": run.failed,
                    "met_slo": run.met_slo,
                    "goodput": run.goodput,
                    "throughput": run.throughput,
                    "ttft_p50_s": ttft["p50"],
                    "ttft_p99_s": ttft["p99"],
                    "tbt_p50_s": tbt["p50"],
                    "tbt_p99_s": tbt["p99"],
                }
            )
    return path


def _figures(result: BenchResult, summaries: list[Summary], out: Path) -> list[Path]:
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
        ax.set_xlabel("output token")
        ax.set_ylabel("mean arrival (s)")
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
    # the bandwidth sweep: TTST per scheme over link rate
    links = sorted({r.link_gbps for r in result.regimes})
    if len(links) > 1:
        fig, ax = plt.subplots(figsize=(7, 4))
        for scheme in schemes:
            pairs = sorted(
                (result.regimes[s.point].link_gbps, s.ttst["mean"])
                for s in summaries
                if s.scheme == scheme and s.ttst["mean"] is not None
            )
            ax.plot([p[0] for p in pairs], [p[1] for p in pairs], marker="o", label=scheme)
        ax.set_xscale("log")
        ax.set_xlabel("link (Gbit/s)")
        ax.set_ylabel("TTST (s)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(_save(fig, out / "bandwidth.png", plt))
    return written


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
