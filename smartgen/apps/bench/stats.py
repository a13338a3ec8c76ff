"""Summaries of a benchmark: per point and scheme, timings with spread, bytes per path, ratios, the physical bound.

Timings are the streaming client's (`ttft`, `ttst`, `tbt`, `e2e`, `itl`, `ctl`: client.py) with the decode node's own
beside them (`node_ttft`, `node_ttst`, `node_tbt`, `node_ctl`) and, per request, the client's minus the node's
(`minus_node`); ratios against full transfer and the bounds are of the client's.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from smartgen.apps.bench.config import Point
from smartgen.apps.bench.fetch_link import fetch_link_per_step
from smartgen.apps.bench.percentiles import percentile
from smartgen.apps.bench.results import BenchResult, Group, Regime
from smartgen.engine.metrics import FETCH_KINDS
from smartgen.lanes.rate import bytes_per_second

__all__ = ["Summary", "summarize", "percentile", "round_spread", "ROUND_METRICS", "NODE_METRICS"]

NODE_METRICS = ("ttft", "ttst", "tbt")  # the timings both the client and the node measure
# the timings whose spread across measured rounds is reported: the client's, then the node's
ROUND_METRICS = (*NODE_METRICS, *(f"node_{m}" for m in NODE_METRICS))


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


@dataclass(slots=True)
class Summary:
    """One scheme at one point, over its measured (not warm-up) rounds."""

    point: int
    scheme: str
    requests: int
    failed: int
    ttft: dict[str, float | None]  # mean, p50, p99, min, max (seconds), as the streaming client saw them
    ttst: dict[str, float | None]
    tbt: dict[str, float | None]
    ctl: list[float]  # mean arrival of text chunk t at the client, seconds from sending
    on_demand_ratio: float | None
    first_step_coverage: float | None  # share of the first decode step's selection local when it ran
    first_step_wait: float | None  # seconds the first decode step waited for the link (layers 0-1, fetches)
    wait_per_step: float | None  # seconds each later step waited for fetches, on average
    # seconds of the link the batch's fetched bytes take per decode step (fetch_link.py), mean over rounds
    fetch_link_per_step: float | None
    bytes_per_request: dict[str, float]  # per path
    descriptors_per_request: float
    posting_s_per_request: float
    link_utilisation: float | None  # prefill->decode link bytes / (rate x wall time): the direction KV crosses
    accuracy: float | None  # mean score, 0-1
    vs_full: dict[str, float | None] = field(default_factory=dict)  # ratios against full transfer
    ttst_bound: float | None = None  # prefill + what prefill cannot hide + one all-local step
    # the same, with step one's selection also on the decode node first: a perfect step-one prediction's TTST
    ttst_bound_selection: float | None = None
    selection_union: list[float] = field(default_factory=list)  # mean bytes of distinct entries selected by token t
    # the least arrival of token t: all-local steps after the prefill, and the link having carried layers 0-1,
    # the metadata and every entry selected by then (as a perfect predictor would have sent them, in order)
    ctl_bound: list[float] = field(default_factory=list)
    tbt_floor: float | None = None  # the mean TBT if every token came at its ctl_bound
    # the all-local step with the point's batch decoding together, emulation included (local_tbt), and TBT over it
    tbt_local: float | None = None
    tbt_vs_local: float | None = None
    # per timing (ROUND_METRICS), across measured rounds: each round's median request, their median, min and max
    rounds: dict[str, dict[str, Any]] = field(default_factory=dict)
    # decode->prefill bytes (fetch requests, idle notices, acks) / (rate x wall time); each way has its own pacer
    link_utilisation_back: float | None = None
    # the decode node's own clock (from the request's arrival there), as `ttft` ... are the client's
    node_ttft: dict[str, float | None] = field(default_factory=dict)
    node_ttst: dict[str, float | None] = field(default_factory=dict)
    node_tbt: dict[str, float | None] = field(default_factory=dict)
    node_ctl: list[float] = field(default_factory=list)  # mean arrival of token t on the node
    # per timing (NODE_METRICS), the client's minus the node's of each request: mean, p50, p99, min, max
    minus_node: dict[str, dict[str, float | None]] = field(default_factory=dict)
    e2e: dict[str, float | None] = field(default_factory=dict)  # the client's, sending to the stream's end
    itl: dict[str, float | None] = field(default_factory=dict)  # every gap between the client's chunks, pooled
    short_streams: int = 0  # requests whose stream carried fewer text chunks than tokens (empty-text tokens)
    # joins.py: the joins of the measured rounds, and over them each join's p99 of running requests' gaps
    joins: int = 0
    join_p99: dict[str, float | None] = field(default_factory=dict)  # mean, p50, p99, min, max (seconds)
    # one fetch on the decode node, from sending its FETCH to landing its reply (seconds, mean over the measured
    # rounds' fetches), and the link's time for its bytes alone: their difference is what a fetch waits beyond
    # its own bytes (queued behind other transfers, the prefill node's turn to serve it, the handoffs)
    fetch_round_trip: float | None = None
    fetch_link: float | None = None
    fetch_round_trip_by_kind: dict[str, float | None] = field(default_factory=dict)  # metrics.FETCH_KINDS
    # a decode step's waits for fetch replies by the kind it waited for (seconds a step, over the measured rounds'
    # steps; `fetch_wait_by_kind`); {} where no step was counted or the results predate it
    fetch_wait_by_kind: dict[str, float] = field(default_factory=dict)
    # the decode node's step by batch size over the measured rounds (`step_parts`): steps, and the mean seconds of
    # its wall, its thread's CPU, the emulated compute, the link waits and the rest (the thread runnable, not running)
    step_by_batch: dict[str, dict[str, float]] = field(default_factory=dict)
    # of the entries decode steps fetched for themselves, the share an earlier idle notice had hinted: hints the
    # speculative push had not brought in time (None: no step fetched)
    late_hint_share: float | None = None


def fetch_wait_by_kind(groups: list[Group]) -> dict[str, float]:
    """A decode step's waits for fetch replies by the kind of reply waited for (metrics.FETCH_KINDS: its own
    fetch, a prefetch asked a layer ahead, a joiner's forecast), seconds a step over these groups' steps; {} with no
    step counted, or from results without the waits."""
    steps = sum(row[0] for group in groups for row in group.steps.values())
    if not steps or not any(len(row) > 2 for group in groups for row in group.fetch_kinds.values()):
        return {}
    return {
        kind: sum(float(g.fetch_kinds[kind][2]) for g in groups if len(g.fetch_kinds.get(kind, ())) > 2) / steps
        for kind in FETCH_KINDS
    }


def step_parts(groups: list[Group]) -> dict[str, dict[str, float]]:
    """The decode step by batch size over these groups: how many steps, and per step the mean wall time, the step
    thread's CPU, the emulated compute, the link waits, and `other`, the wall none of those explain (the thread
    runnable but not running: the node's other threads on its CPU, the GIL), and `preempted`, the times a step another
    thread took its CPU (left out for a node that did not count them)."""
    sums: dict[str, list[float]] = {}
    for group in groups:
        for batch, row in group.steps.items():
            total = sums.setdefault(batch, [0.0] * len(row))
            for i, value in enumerate(row):
                total[i] += value
    parts: dict[str, dict[str, float]] = {}
    for batch in sorted(sums, key=int):
        steps, wall, cpu, emulated, wait, *counted = sums[batch]
        parts[batch] = {
            "steps": steps,
            "wall_s": wall / steps,
            "cpu_s": cpu / steps,
            "emulated_s": emulated / steps,
            "wait_s": wait / steps,
            "other_s": max(0.0, wall - cpu - emulated - wait) / steps,
        }
        if counted:  # results of before the count keep five fields
            parts[batch]["preempted"] = counted[0] / steps
    return parts


def _stats(values: list[float]) -> dict[str, float | None]:
    return {
        "mean": _mean(values),
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "min": min(values) if values else None,
        "max": max(values) if values else None,
    }


def round_spread(groups: list[Group], key: str) -> dict[str, Any]:
    """`key` (ttft, ttst or tbt) across rounds: each round's median over its finished requests (`per_round`, in
    round order), then the median, min and max of those. One value per round, so a round with a large batch
    weighs no more than one with a small one, and min-max shows how much a round-to-round difference means."""
    per_round = []
    for group in sorted(groups, key=lambda g: g.rep):
        values = [float(r[key]) for r in group.requests if not r.get("error") and r.get(key) is not None]
        if values:
            per_round.append(statistics.median(values))
    return {
        "per_round": per_round,
        "median": statistics.median(per_round) if per_round else None,
        "min": min(per_round, default=None),
        "max": max(per_round, default=None),
    }


def _summarize_groups(point: int, scheme: str, groups: list[Group], regime: Regime) -> Summary:
    requests = [r for g in groups for r in g.requests]
    ok = [r for r in requests if not r.get("error")]

    def values(key: str) -> list[float]:
        return [float(r[key]) for r in ok if r.get(key) is not None]

    def minus_node(key: str) -> list[float]:
        return [
            float(r[key]) - float(r[f"node_{key}"])
            for r in ok
            if r.get(key) is not None and r.get(f"node_{key}") is not None
        ]

    joins = [j for g in groups for j in g.joins]
    num = max(len(requests), 1)
    paths = {path: sum(g.path_bytes[path] for g in groups) / num for path in groups[0].path_bytes} if groups else {}
    rate = bytes_per_second(regime.link_gbps)
    wall = sum(g.wall_s for g in groups)
    scores = [float(r["score"]) for r in ok if r.get("score") is not None]
    return Summary(
        point=point,
        scheme=scheme,
        requests=len(requests),
        failed=len(requests) - len(ok),
        ttft=_stats(values("ttft")),
        ttst=_stats(values("ttst")),
        tbt=_stats(values("tbt")),
        ctl=_curve([r.get("ctl") for r in ok]),
        selection_union=_curve([r.get("selection_union_bytes") for r in ok]),
        on_demand_ratio=_mean(values("on_demand_ratio")),
        first_step_coverage=_mean(values("first_step_coverage")),
        first_step_wait=_mean(values("first_step_wait")),
        wait_per_step=_mean(
            [
                (float(r["fetch_wait"]) - float(r.get("first_step_wait") or 0.0)) / (r["completion_tokens"] - 2)
                for r in ok
                if r.get("fetch_wait") is not None and (r.get("completion_tokens") or 0) > 2
            ]
        ),
        fetch_link_per_step=_mean(
            [
                value
                for g in groups
                if (value := fetch_link_per_step(g.requests, g.path_bytes.get("on_demand", 0.0), rate)) is not None
            ]
        ),
        bytes_per_request=paths,
        descriptors_per_request=sum(g.descriptors for g in groups) / num,
        posting_s_per_request=sum(g.posting_s for g in groups) / num,
        link_utilisation=sum(g.link_bytes for g in groups) / (rate * wall) if wall > 0 else None,
        accuracy=_mean(scores),
        rounds={key: round_spread(groups, key) for key in ROUND_METRICS},
        link_utilisation_back=sum(g.link_bytes_back for g in groups) / (rate * wall) if wall > 0 else None,
        node_ttft=_stats(values("node_ttft")),
        node_ttst=_stats(values("node_ttst")),
        node_tbt=_stats(values("node_tbt")),
        node_ctl=_curve([r.get("node_ctl") for r in ok]),
        minus_node={key: _stats(minus_node(key)) for key in NODE_METRICS},
        e2e=_stats(values("e2e")),
        itl=_stats([float(gap) for r in ok for gap in r.get("itl") or []]),
        short_streams=sum(
            1
            for r in ok
            if r.get("client_tokens") is not None and r["client_tokens"] < (r.get("completion_tokens") or 0)
        ),
        joins=len(joins),
        join_p99=_stats([float(j["p99"]) for j in joins]),
        late_hint_share=_ratio(
            sum(float(r.get("step_fetched_hinted") or 0) for r in ok),
            sum(float(r.get("step_fetched") or 0) for r in ok),
        ),
        fetch_round_trip=_ratio(sum(g.fetch_s for g in groups), sum(g.fetches for g in groups)),
        fetch_round_trip_by_kind={
            kind: _ratio(
                sum(g.fetch_kinds.get(kind, [0, 0.0])[1] for g in groups),
                sum(g.fetch_kinds.get(kind, [0, 0.0])[0] for g in groups),
            )
            for kind in FETCH_KINDS
        },
        step_by_batch=step_parts(groups),
        fetch_wait_by_kind=fetch_wait_by_kind(groups),
        fetch_link=_ratio(
            sum(g.path_bytes.get("on_demand", 0) for g in groups) / rate if rate else None,
            sum(g.fetches for g in groups),
        ),
    )


def _curve(series: list[list[float] | None]) -> list[float]:
    """The mean of each position over the series that have one, as deep as the shortest non-empty one."""
    present = [s for s in series if s]
    depth = min((len(s) for s in present), default=0)
    return [statistics.fmean(s[t] for s in present) for t in range(depth)]


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def summarize(result: BenchResult) -> list[Summary]:
    """Per point and scheme (in the config's order), with ratios against full transfer and the TTST bound."""
    summaries = []
    for index, (point, regime) in enumerate(zip(result.points, result.regimes)):
        measured = [g for g in result.groups if g.point == index and not g.warmup]
        per_scheme = [
            _summarize_groups(index, scheme, [g for g in measured if g.scheme == scheme], regime)
            for scheme in result.config.all_schemes
        ]
        full = next(s for s in per_scheme if s.scheme == "full")
        for s in per_scheme:
            s.vs_full = {  # of the client's timings
                "ttft": _ratio(s.ttft["mean"], full.ttft["mean"]),  # > 1: slower than full transfer
                "ttst_speedup": _ratio(full.ttst["mean"], s.ttst["mean"]),  # > 1: faster than full transfer
                "tbt": _ratio(s.tbt["mean"], full.tbt["mean"]),  # > 1: slower than full transfer
                "accuracy": _ratio(s.accuracy, full.accuracy),
                # the same two of the rounds' medians, which the terminal shows
                "ttst_speedup_median": _ratio(full.rounds["ttst"]["median"], s.rounds["ttst"]["median"]),
                "tbt_median": _ratio(s.rounds["tbt"]["median"], full.rounds["tbt"]["median"]),
            }
            sharing = link_sharing(point)
            s.ttst_bound = ttst_bound(point.length, regime, full, s, sharing=sharing)
            s.ttst_bound_selection = ttst_bound(
                point.length, regime, full, s, selection_budget=point.budget, sharing=sharing
            )
            s.ctl_bound = ctl_bound(point.length, regime, full, s, sharing=sharing)
            if len(s.ctl_bound) > 2:
                s.tbt_floor = (s.ctl_bound[-1] - s.ctl_bound[1]) / (len(s.ctl_bound) - 2)
            s.tbt_local = local_tbt(regime, point.length, point.batch)
            s.tbt_vs_local = _ratio(s.tbt["mean"], s.tbt_local)
        summaries.extend(per_scheme)
    return summaries


def local_tbt(regime: Regime, length: int, batch: int) -> float | None:
    """The all-local step of `batch` requests decoding together at `length` tokens, with the emulated compute: the
    TBT no scheme's requests can beat while they share a step (local_step.py). Batch 1 is the pilot's step; None
    where the pilot has no figure for it."""
    native = regime.step_s.get(length) if batch == 1 else regime.batch_step_s.get(length, {}).get(batch)
    if native is None:
        return None
    if regime.emulate_floor_ms:  # each layer topped up to the floor: the batch's compute, where it fits, is hidden
        return max(native, regime.emulate_floor_ms * regime.num_layers / 1e3)
    return native + regime.emulate_layer_ms * regime.num_layers / 1e3


def link_sharing(point: Point) -> int:
    """Requests of one round that share a prefill node's link: the batch spread over the prefill nodes."""
    return max(1, math.ceil(point.batch / max(point.prefill_nodes, 1)))


def ctl_bound(length: int, regime: Regime, full: Summary, scheme: Summary, sharing: int = 1) -> list[float]:
    """Per output token t, the least arrival any lossless scheme with this selection could reach.

    Token 0 comes after the prefill (full transfer's TTFT). Token t >= 1 comes no earlier than t all-local
    steps after it (full transfer's TBT each), nor before the link has carried layers 0-1, the selector
    metadata and every entry steps 1..t selected (`selection_union`), counting from the request's arrival:
    what a proactive and speculative push that knew every future selection could reach. `sharing` requests
    (a batch on one prefill node) each need that much of the one link. Empty when the scheme's requests did
    not report their selections.
    """
    prefill, step = full.ttft["mean"], full.tbt["mean"]
    if prefill is None or step is None or not scheme.selection_union:
        return []
    rate = bytes_per_second(regime.link_gbps)
    layers = regime.num_layers
    fixed = 2 / layers * regime.kv_bytes_per_token * length + scheme.bytes_per_request.get("metadata", 0.0)
    bound = [prefill]
    for t, union in enumerate(scheme.selection_union[1:], start=1):
        bound.append(max(prefill + t * step, sharing * (fixed + union) / rate))
    return bound


def ttst_bound(
    length: int,
    regime: Regime,
    full: Summary,
    scheme: Summary,
    selection_budget: float | None = None,
    sharing: int = 1,
) -> float | None:
    """The least TTST any scheme could reach here: prefill, then what prefill cannot hide, then one all-local step.

    Only layers 0-1 and the selector metadata must be on the decode node before its first step;
    the link carries them while layers 1..L-1 prefill, so only what does not fit in that time adds
    to the prefill. Prefill is full transfer's TTFT at this point (it includes queueing in a batch),
    the step its mean TBT (every entry local).

    `selection_budget`: the first step's selection (that share of every layer >= 2) must be there too, as
    when the proactive set predicts it exactly: the least TTST of a lossless scheme selecting that budget.
    `sharing`: requests of a batch whose bytes cross the same link (each needs its own).
    """
    prefill, step = full.ttft["mean"], full.tbt["mean"]
    if prefill is None or step is None:
        return None
    layers = regime.num_layers
    must_move = 2 / layers * regime.kv_bytes_per_token * length + scheme.bytes_per_request.get("metadata", 0.0)
    if selection_budget is not None:
        tokens = min(length, selection_budget * length if selection_budget <= 1 else selection_budget)
        must_move += max(layers - 2, 0) / layers * regime.kv_bytes_per_token * tokens
    hidden = prefill * (layers - 1) / layers
    exposed = max(0.0, sharing * must_move / bytes_per_second(regime.link_gbps) - hidden)
    return prefill + exposed + step
