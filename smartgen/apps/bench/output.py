"""A benchmark's output folder: results.json (everything), summary.csv, and the PNG figures (figures.py)."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from smartgen.apps.bench.figures import figures, goodput_figure
from smartgen.apps.bench.goodput import LATENCIES, PERCENTILES
from smartgen.apps.bench.runner import BenchResult
from smartgen.apps.bench.stats import NODE_METRICS, ROUND_METRICS, Summary
from smartgen.engine.metrics import FETCH_KINDS

__all__ = ["write_outputs", "CSV_COLUMNS"]

ROUND_KEYS = ("median", "min", "max")
STAT_KEYS = ("mean", "p50", "p99")
MINUS_KEYS = ("mean", "p50", "max")  # of client - node: the max is where a late first token shows

CSV_COLUMNS = (
    "point",
    "lane",
    "batch",
    "length",
    "link_gbps",
    "stall_ratio",
    "decode_ratio",
    "decode_emulation",  # how the decode device was emulated: added, floor, or native (none)
    "blocks",
    "budget",
    "speculative_ratio",
    "prefill_nodes",
    "prefix_hit",
    "scheme",
    "requests",
    "failed",
    # the client's timings (ttft_mean_s, ...), the node's (node_ttft_mean_s, ...), client - node per request
    *(f"{m}_{k}_s" for m in NODE_METRICS for k in STAT_KEYS),
    *(f"node_{m}_{k}_s" for m in NODE_METRICS for k in STAT_KEYS),
    *(f"{m}_minus_node_{k}_s" for m in NODE_METRICS for k in MINUS_KEYS),
    *(f"e2e_{k}_s" for k in STAT_KEYS),
    "itl_p50_s",
    "itl_p99_s",
    "short_streams",
    "rounds",
    *(f"{m}_round_{k}_s" for m in ROUND_METRICS for k in ROUND_KEYS),  # ttft_round_median_s, ..., node_tbt_...
    "joins",
    "join_p99_median_s",
    "join_p99_max_s",
    "ttst_speedup_vs_full",
    "ttft_vs_full",
    "tbt_vs_full",
    "ttst_speedup_median_vs_full",
    "tbt_median_vs_full",
    "ttst_bound_s",
    "ttst_bound_selection_s",
    "tbt_floor_s",
    "tbt_local_s",
    "tbt_vs_local",
    "on_demand_ratio",
    "first_step_coverage",
    "late_hint_share",
    "first_step_wait_s",
    "wait_per_step_s",
    "fetch_round_trip_s",
    *(f"fetch_round_trip_{kind}_s" for kind in FETCH_KINDS),
    *(f"fetch_wait_{kind}_s" for kind in FETCH_KINDS),
    "fetch_link_s",
    "fetch_link_per_step_s",
    "full_bytes",
    "proactive_bytes",
    "on_demand_bytes",
    "speculative_bytes",
    "metadata_bytes",
    "descriptors",
    "posting_s",
    "link_utilisation",
    "link_utilisation_back",
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
        "decode_emulation": "floor" if regime.emulate_floor_ms else "added" if regime.emulate_layer_ms else "native",
        "blocks": point.blocks,
        "budget": point.budget,
        "speculative_ratio": point.speculative_ratio,
        "prefill_nodes": point.prefill_nodes,
        "prefix_hit": point.prefix_hit,
        "scheme": s.scheme,
        "requests": s.requests,
        "failed": s.failed,
        **{f"{m}_{k}_s": getattr(s, m).get(k) for m in NODE_METRICS for k in STAT_KEYS},
        **{f"node_{m}_{k}_s": getattr(s, f"node_{m}").get(k) for m in NODE_METRICS for k in STAT_KEYS},
        **{f"{m}_minus_node_{k}_s": s.minus_node.get(m, {}).get(k) for m in NODE_METRICS for k in MINUS_KEYS},
        **{f"e2e_{k}_s": s.e2e.get(k) for k in STAT_KEYS},
        "itl_p50_s": s.itl.get("p50"),
        "itl_p99_s": s.itl.get("p99"),
        "short_streams": s.short_streams,
        # spread across measured rounds: each round's median request, then their median, min and max
        "rounds": len(s.rounds["ttst"]["per_round"]) if s.rounds else 0,
        **{f"{m}_round_{k}_s": s.rounds[m][k] if s.rounds else None for m in ROUND_METRICS for k in ROUND_KEYS},
        "joins": s.joins,
        "join_p99_median_s": s.join_p99.get("p50"),
        "join_p99_max_s": s.join_p99.get("max"),
        "ttst_speedup_vs_full": s.vs_full.get("ttst_speedup"),
        "ttft_vs_full": s.vs_full.get("ttft"),
        "tbt_vs_full": s.vs_full.get("tbt"),
        "ttst_speedup_median_vs_full": s.vs_full.get("ttst_speedup_median"),
        "tbt_median_vs_full": s.vs_full.get("tbt_median"),
        "ttst_bound_s": s.ttst_bound,
        "ttst_bound_selection_s": s.ttst_bound_selection,
        "tbt_floor_s": s.tbt_floor,
        "tbt_local_s": s.tbt_local,
        "tbt_vs_local": s.tbt_vs_local,
        "on_demand_ratio": s.on_demand_ratio,
        "first_step_coverage": s.first_step_coverage,
        "late_hint_share": s.late_hint_share,
        "first_step_wait_s": s.first_step_wait,
        "wait_per_step_s": s.wait_per_step,
        "fetch_round_trip_s": s.fetch_round_trip,
        **{f"fetch_round_trip_{kind}_s": s.fetch_round_trip_by_kind.get(kind) for kind in FETCH_KINDS},
        **{f"fetch_wait_{kind}_s": s.fetch_wait_by_kind.get(kind) for kind in FETCH_KINDS},
        "fetch_link_s": s.fetch_link,
        "fetch_link_per_step_s": s.fetch_link_per_step,
        **{f"{p}_bytes": paths.get(p, 0.0) for p in ("full", "proactive", "on_demand", "speculative", "metadata")},
        "descriptors": s.descriptors_per_request,
        "posting_s": s.posting_s_per_request,
        "link_utilisation": s.link_utilisation,
        "link_utilisation_back": s.link_utilisation_back,
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
        written.extend(goodput_figure(result, out))
        return written  # the other figures draw rounds; a load run has none
    written.extend(figures(result, summaries, out))
    return written


LOAD_COLUMNS = (
    "point",
    "length",
    "link_gbps",
    "mode",
    "scheme",
    "router",
    "offered_rate",
    "requests",
    "served",
    "failed",
    "refused",
    "met_slo",
    "slo_ttft_s",
    "slo_ttst_s",
    "slo_tbt_s",
    "duration_s",
    "goodput",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    # the client's latencies as vLLM names them: ttft_mean_s, ttft_p50_s, ttft_p90_s, ttft_p99_s, ...
    *(f"{m}_{k}_s" for m in LATENCIES for k in ("mean", *(f"p{q}" for q in PERCENTILES))),
    "node_ttft_p50_s",
    "node_ttft_p99_s",
    "node_tbt_p50_s",
    "node_tbt_p99_s",
    "ttft_minus_node_p50_s",
    "ttft_minus_node_max_s",
    "queue_decode_s",
    "queue_prefill_s",
    "link_utilisation",
    "link_utilisation_back",
    "link_bytes",
    "link_bytes_back",
    "prefix_hit_rate_prefill",
    "prefix_hit_rate_decode",
    "failures",
)


def _load_csv(result: BenchResult, path: Path) -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=LOAD_COLUMNS)
        writer.writeheader()
        for run in result.loads:
            metrics = run.metrics
            node_ttft, node_tbt = run.percentiles("node_ttft"), run.percentiles("node_tbt")
            minus = run.ttft_minus_node()
            nodes = run.nodes
            queue = nodes.get("queue_s") or {}
            hits = nodes.get("prefix_hit_rate") or {}
            writer.writerow(
                {
                    "point": run.point,
                    "length": result.points[run.point].length,
                    "link_gbps": result.regimes[run.point].link_gbps,
                    "mode": run.mode,
                    "scheme": run.scheme,
                    "router": run.router,
                    "offered_rate": run.offered_rate,
                    "requests": metrics.requests,
                    "served": metrics.served,
                    "failed": metrics.failed,
                    "refused": metrics.refused,
                    "met_slo": metrics.met_slo,
                    "slo_ttft_s": run.slos.ttft_s,
                    "slo_ttst_s": run.slos.ttst_s,
                    "slo_tbt_s": run.slos.tbt_s,
                    "duration_s": metrics.duration_s,
                    "goodput": metrics.goodput,
                    "request_throughput": metrics.request_throughput,
                    "output_throughput": metrics.output_throughput,
                    "total_token_throughput": metrics.total_token_throughput,
                    **{f"{m}_{k}_s": v for m, stats in metrics.latencies.items() for k, v in stats.items()},
                    "node_ttft_p50_s": node_ttft["p50"],
                    "node_ttft_p99_s": node_ttft["p99"],
                    "node_tbt_p50_s": node_tbt["p50"],
                    "node_tbt_p99_s": node_tbt["p99"],
                    "ttft_minus_node_p50_s": minus["p50"],
                    "ttft_minus_node_max_s": minus["max"],
                    "queue_decode_s": queue.get("decode"),
                    "queue_prefill_s": queue.get("prefill"),
                    "link_utilisation": nodes.get("link_utilisation"),
                    "link_utilisation_back": nodes.get("link_utilisation_back"),
                    "link_bytes": nodes.get("link_bytes"),
                    "link_bytes_back": nodes.get("link_bytes_back"),
                    "prefix_hit_rate_prefill": hits.get("prefill"),
                    "prefix_hit_rate_decode": hits.get("decode"),
                    "failures": "; ".join(f"{reason} x{n}" for reason, n in metrics.failures.items()),
                }
            )
    return path
