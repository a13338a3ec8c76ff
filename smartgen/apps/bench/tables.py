"""The terminal view of a benchmark: four rich tables per point that fit 80 columns and are never cut when piped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text

from smartgen.apps.bench.config import lane_words
from smartgen.apps.bench.results import Regime
from smartgen.apps.bench.runner import BenchResult
from smartgen.apps.bench.stats import Summary
from smartgen.apps.regime import emulation_words
from smartgen.engine.metrics import FETCH_KINDS

__all__ = [
    "point_tables",
    "steps_table",
    "fetch_waits_table",
    "regime_line",
    "load_table",
    "latency_table",
    "nodes_table",
    "prefix_table",
]

MIB = 2**20


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ms1(value: float | None) -> str:
    """Milliseconds with a tenth: for client - node differences, which should be a few ms."""
    return "-" if value is None else f"{round(value * 1e3, 1) + 0.0:.1f}"  # + 0.0: no "-0.0"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}"


def regime_line(result: BenchResult, point: int) -> str:
    """The regime a point ran in, in one line: link, both ratios, prefill and step time."""
    p, r = result.points[point], result.regimes[point]
    prefill = r.prefill_s.get(p.length)
    step = r.step_s.get(p.length)
    return (
        f"{p.label(result.config.link_mode)}: {lane_words(result.config.lane)}, link {r.link_gbps * 1e3:.1f} Mbit/s, stall ratio {r.stall_ratio:.2f} "
        f"(full transfer / prefill), decode-side ratio {r.decode_ratio:.3f} (link bytes per all-local step / "
        f"selected bytes per step), prefill {_ms(prefill)} ms, step {_ms(step)} ms"
        + emulation_words(r.emulate_layer_ms, r.emulate_floor_ms)
        + _batch_step_words(r, p.length, p.batch)
        + f", CPUs {r.cpus}"
        + pacing_words(r.link, p.prefill_nodes)
    )


def _batch_step_words(r: Regime, length: int, batch: int) -> str:
    """The pilot's all-local step with `batch` requests decoding together, beside batch 1's; "" at batch 1."""
    step, alone = r.batch_step_s.get(length, {}).get(batch), r.step_s.get(length)
    if batch == 1 or step is None:
        return ""
    return f", {batch} requests decoding together {_ms(step)} ms a step" + (
        f" ({step / alone:.2f}x one)" if alone else ""
    )


def pacing_words(link: dict[str, Any], prefill_nodes: int) -> str:
    """Which pacing the decode node said applies (its /status "link"), for the regime line; "" where not read."""
    nodes = f"{prefill_nodes} prefill node{'s' * (prefill_nodes > 1)}"
    if link.get("pacing") == "shared ingress":
        return (
            f", pacing: shared ingress, one {link['ingress_gbps'] * 1e3:.1f} Mbit/s link into the decode node for "
            f"{nodes} (each also sending at most that)"
        )
    if link.get("pacing"):
        return f", pacing: {link['pacing']} ({nodes}, a link each)"
    return ""


def _table(title: str, columns: list[str]) -> Table:
    table = Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1), collapse_padding=True
    )
    for i, column in enumerate(columns):
        # fold: a console narrower than 80 columns folds a cell onto a second line instead of cutting it ("sch…");
        # scheme names stay whole (they are what a reader looks up), the figures fold first
        table.add_column(column, justify="left" if i == 0 else "right", overflow="fold", no_wrap=i == 0)
    return table


def _spread(s: Summary, key: str) -> str:
    """The rounds' max - min of `key` in ms; "-" with fewer than two measured rounds (no spread to show)."""
    rounds = s.rounds.get(key, {})
    if len(rounds.get("per_round", [])) < 2:
        return "-"
    return _ms(rounds["max"] - rounds["min"])


def point_tables(result: BenchResult, summaries: list[Summary], point: int) -> tuple[Table, Table, Table, Table]:
    """(timings, node's clock, transfers, link waits) of one point; rows in the config's scheme order. At most ten
    narrow columns each: with scheme names whole, that is what 80 columns hold without folding figures."""
    rows = [s for s in summaries if s.point == point]
    timings = _table(
        "timings in ms as a streaming client saw them: medians over the measured rounds of each round's median "
        "request; rng: the rounds' max - min; p99: TBT's over requests; x: TTST speed-up and TBT ratio vs full, of "
        "those medians; bound: least TTST possible for a decode node that computes the second token (smartgen's comes "
        "from the prefill node's forecast step, so it may beat it; means, p50 and min-max per request in "
        "results.json and summary.csv)",
        ["scheme", "TTFT", "TTST", "rng", "TBT", "rng", "p99", "TTST x", "TBT x", "bound"],
    )
    for s in rows:
        timings.add_row(
            Text(s.scheme),  # Text: "smartgen[random]" is not markup
            _ms(s.rounds["ttft"]["median"]),
            _ms(s.rounds["ttst"]["median"]),
            _spread(s, "ttst"),
            _ms(s.rounds["tbt"]["median"]),
            _spread(s, "tbt"),
            _ms(s.tbt["p99"]),
            _x(s.vs_full.get("ttst_speedup_median")),
            _x(s.vs_full.get("tbt_median")),
            _ms(s.ttst_bound),
        )
    node = _table(
        "the decode node's own clock, ms, medians over rounds as above; Δ: the client's minus the node's, per "
        "request, their median (max: the largest, where a first token held back shows); short: requests whose "
        "stream had fewer text chunks than tokens (a token with no text of its own leaves with the next); loc x: "
        "the client's TBT (mean) over an all-local step with the point's batch decoding together (the regime "
        "line's batch step, emulation included): what the link and the scheme cost beyond sharing the step",
        ["scheme", "TTFT", "Δ", "max", "TTST", "Δ", "TBT", "Δ", "short", "loc x"],
    )
    for s in rows:
        minus = s.minus_node
        node.add_row(
            Text(s.scheme),
            _ms(s.rounds["node_ttft"]["median"]),
            _ms1(minus["ttft"]["p50"]),
            _ms1(minus["ttft"]["max"]),
            _ms(s.rounds["node_ttst"]["median"]),
            _ms1(minus["ttst"]["p50"]),
            _ms(s.rounds["node_tbt"]["median"]),
            _ms1(minus["tbt"]["p50"]),
            str(s.short_streams),
            _x(s.tbt_vs_local),
        )
    transfers = _table(
        "per request, MiB by path (push: proactive or full, fetch: on-demand, spec: speculative, meta: selector "
        "metadata); od%: on-demand ratio; link%: utilisation of the prefill -> decode direction (the KV's; the "
        "other way, link_utilisation_back in the files, is requests and notices); acc%: answers right; acc x: "
        "accuracy relative to full transfer's",
        ["scheme", "push", "fetch", "spec", "meta", "od%", "link%", "acc%", "acc x"],
    )
    for s in rows:
        paths = s.bytes_per_request
        failed = f" ({s.failed} failed)" if s.failed else ""
        transfers.add_row(
            Text(s.scheme + failed),
            f"{(paths.get('proactive', 0) + paths.get('full', 0)) / MIB:.1f}",
            f"{paths.get('on_demand', 0) / MIB:.1f}",
            f"{paths.get('speculative', 0) / MIB:.1f}",
            f"{paths.get('metadata', 0) / MIB:.2f}",
            _pct(s.on_demand_ratio),
            _pct(s.link_utilisation),
            _pct(s.accuracy),
            _x(s.vs_full.get("accuracy")),
        )
    waits = _table(
        "where TTST and TBT go: cov1%: the decode node's first step's selection (layers >= 2) already local (its "
        "third token's step where the prefill node gave the second); wait1: "
        "that step's wait for the link (ms); wait: each later step's (ms); fetch: the link's time (ms) for one "
        "decode step's fetches of the whole batch (fetched bytes per token x the mean batch a token shared its "
        "step with / the link's rate: where it nears full's TBT, TBT is the link's); desc: descriptors posted per request, "
        "post: ms the lanes spent posting them (framing, send calls, writes; pacer waits left out); bound1: least "
        "TTST (ms) if the proactive set were exactly the first step's "
        "selection (what prefill cannot hide of layers 0-1, metadata and that selection); TBT fl: mean TBT (ms) "
        "if every token came as early as the link and all-local steps allow (ctl.png's dashed bound); join: per "
        "request that joined others decoding, the p99 of their token gaps from its first token to the first its "
        "decode node computed, the median over joins (ms; - with none); rtt: one fetch from its FETCH to its "
        "reply landed, a step's own / every kind's (prefetches and forecasts too) / the link's time for a "
        "fetch's bytes alone (ms, means over the fetches)",
        ["scheme", "cov1%", "wait1", "wait", "fetch", "desc", "post", "bound1", "TBT fl", "join", "rtt"],
    )
    for s in rows:
        waits.add_row(
            Text(s.scheme),
            _pct(s.first_step_coverage),
            _ms(s.first_step_wait),
            _ms(s.wait_per_step),
            _ms(s.fetch_link_per_step),
            f"{s.descriptors_per_request:.0f}",
            _ms(s.posting_s_per_request),
            _ms(s.ttst_bound_selection),
            _ms(s.tbt_floor),
            _ms(s.join_p99.get("p50")),
            (
                f"{_ms1(s.fetch_round_trip_by_kind.get('step'))} / {_ms1(s.fetch_round_trip)} / {_ms1(s.fetch_link)}"
                if s.fetch_round_trip is not None
                else "-"
            ),
        )
    return timings, node, transfers, waits


def steps_table(summaries: list[Summary], point: int) -> Table | None:
    """The decode node's step by batch size for each scheme of one point (None when no round recorded steps)."""
    rows = [s for s in summaries if s.point == point and s.step_by_batch]
    if not rows:
        return None
    table = _table(
        "the decode step by batch size (ms per step, means over the measured rounds' steps): B: requests in the "
        "step; wall: the step's time; cpu: its thread's own CPU; emul: the emulated compute it slept; wait: its "
        "waits for the link (fetch replies, layers 0-1); other: the rest, its thread runnable but not running (the "
        "node's other threads on its CPU, the GIL); pre: the times a step another thread took its CPU. A scheme's "
        "TBT over an all-local step of the same batch is wait + other + the cpu beyond that step's",
        ["scheme", "B", "steps", "wall", "cpu", "emul", "wait", "other", "pre"],
    )
    for s in rows:
        for batch, parts in s.step_by_batch.items():
            table.add_row(
                Text(s.scheme),
                batch,
                f"{parts['steps']:.0f}",
                _ms(parts["wall_s"]),
                _ms(parts["cpu_s"]),
                _ms(parts["emulated_s"]),
                _ms(parts["wait_s"]),
                _ms(parts["other_s"]),
                f"{parts['preempted']:.0f}" if "preempted" in parts else "-",
            )
    return table


def fetch_waits_table(summaries: list[Summary], point: int) -> Table | None:
    """Each scheme's decode step link waits by the fetch reply waited for, for one point (None when no scheme
    fetched)."""
    rows = [s for s in summaries if s.point == point and any(s.fetch_wait_by_kind.values())]
    if not rows:
        return None
    table = _table(
        "what a decode step's waits for fetch replies waited for (ms a step, means over the measured rounds' steps; "
        "the step table's wait less layers 0-1): step: the step's own fetch of what it selected and found remote; "
        "prefetch: one asked a layer ahead from a speculated query; forecast: a joiner's fetch of its forecast picks",
        ["scheme", *FETCH_KINDS],
    )
    for s in rows:
        table.add_row(Text(s.scheme), *(_ms1(s.fetch_wait_by_kind.get(kind)) for kind in FETCH_KINDS))
    return table


def _runs(result: BenchResult, point: int) -> list[Any]:
    return [r for r in result.loads if r.point == point]


def _run_label(result: BenchResult, run: Any) -> Text:
    """The scheme, and the offered rate where several rates ran (a sweep)."""
    swept = len({r.offered_rate for r in result.loads}) > 1
    return Text(f"{run.label}@{_rate(run.offered_rate)}" if swept else run.label)


def _rate(value: float | None) -> str:
    """An offered rate in requests per second; "once" where a trace slice's requests all arrive at once."""
    return "once" if value is None else f"{value:.3g}"


def load_table(result: BenchResult, point: int) -> Table:
    """Load and trace modes, one point: per scheme (and rate), every request accounted for, goodput, throughput."""
    runs = _runs(result, point)
    slos = runs[0].slos.words() if runs else "-"
    if result.trace is not None:
        trace = result.trace
        how = (
            f"trace {Path(trace['path']).name}: {trace['requests']} requests ({trace['clipped']} clipped, "
            f"{trace['refused']} refused over --max-input), {trace['block_tokens']} tokens per hash id"
        )
    else:
        config = result.config
        how = f"Poisson load for {config.load_duration_s:g} s"
    table = _table(
        f"{how}; goodput: req/s served within {slos}, as the streaming client saw them; ok: served, fail: failed "
        "with a reason, ref: refused (files: failures by reason); req/s and tok/s: served requests and output "
        "tokens per second of the run (first sent to last ended); Δ: the client's TTFT minus the node's, median, ms",
        ["scheme", "rate", "sent", "ok", "fail", "ref", "good/s", "req/s", "tok/s", "Δ"],
    )
    for run in runs:
        metrics = run.metrics
        table.add_row(
            _run_label(result, run),
            _rate(run.offered_rate),
            str(metrics.requests),
            str(metrics.served),
            str(metrics.failed),
            str(metrics.refused),
            f"{metrics.goodput:.2f}",
            f"{metrics.request_throughput:.2f}",
            f"{metrics.output_throughput:.1f}",
            _ms1(run.ttft_minus_node()["p50"]),
        )
    return table


def latency_table(result: BenchResult, point: int) -> Table:
    """Load and trace modes, one point: per scheme, each latency's mean and p50 / p90 / p99 as vLLM reports them."""
    table = _table(
        "latencies in ms as the client saw them (vllm bench serve's definitions): TTFT, TTST (second token: the "
        "stall), TBT (mean gap after the second token, per request), TPOT ((e2e - TTFT) / (tokens - 1)), ITL (every "
        "gap between chunks, pooled), E2E",
        ["scheme", "metric", "mean", "p50", "p90", "p99"],
    )
    for run in _runs(result, point):
        latencies = run.metrics.latencies
        for i, (key, name) in enumerate(LATENCY_NAMES.items()):
            stats = latencies[key]
            label = _run_label(result, run) if i == 0 else Text("")
            table.add_row(label, name, _ms(stats["mean"]), _ms(stats["p50"]), _ms(stats["p90"]), _ms(stats["p99"]))
    return table


def nodes_table(result: BenchResult, point: int) -> Table:
    """Load and trace modes, one point: queueing, link use each way and prefix-cache hits, as the nodes saw them."""
    table = _table(
        "what the nodes saw: qD / qP: mean ms a request queued for a decode pool slot / for prefill (Little's law "
        "over the nodes' sampled queues); link>% / link<%: utilisation of the prefill -> decode direction (the KV's) "
        "and of the way back, over the run; hitP% / hitD%: prompt tokens the prefill / decode prefix cache held, of "
        "those looked up",
        ["scheme", "qD", "qP", "link>%", "link<%", "hitP%", "hitD%"],
    )
    for run in _runs(result, point):
        nodes = run.nodes
        queue = nodes.get("queue_s") or {}
        hits = nodes.get("prefix_hit_rate") or {}
        table.add_row(
            _run_label(result, run),
            _ms(queue.get("decode")),
            _ms(queue.get("prefill")),
            _pct(nodes.get("link_utilisation")),
            _pct(nodes.get("link_utilisation_back")),
            _pct(hits.get("prefill")),
            _pct(hits.get("decode")),
        )
    return table


def placement_table(result: BenchResult, point: int) -> Table | None:
    """Trace mode behind the router, one point: per scheme and router policy, what placement changed (None when no
    router placed the requests)."""
    runs = [run for run in _runs(result, point) if run.router is not None]
    if not runs:
        return None
    table = _table(
        f"placement over {result.config.decode_nodes} decode nodes by SGLang's router: hitD%: prompt tokens the "
        "decode nodes' prefix caches held, of those looked up; MB>: bytes over the links into the decode nodes (KV, "
        "replies), MB<: back; TTFT and TTST p50 / p99 in ms as the client saw them",
        ["scheme/router", "hitD%", "hitP%", "MB>", "MB<", "TTFT50", "TTFT99", "TTST50", "TTST99"],
    )
    for run in runs:
        nodes, latencies = run.nodes, run.metrics.latencies
        hits = nodes.get("prefix_hit_rate") or {}
        table.add_row(
            _run_label(result, run),
            _pct(hits.get("decode")),
            _pct(hits.get("prefill")),
            f"{nodes.get('link_bytes', 0) / 1e6:.1f}",
            f"{nodes.get('link_bytes_back', 0) / 1e6:.2f}",
            _ms(latencies["ttft"]["p50"]),
            _ms(latencies["ttft"]["p99"]),
            _ms(latencies["ttst"]["p50"]),
            _ms(latencies["ttst"]["p99"]),
        )
    return table


LATENCY_NAMES = {"ttft": "TTFT", "ttst": "TTST", "tbt": "TBT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E"}


def prefix_table(result: BenchResult, summaries: list[Summary]) -> Table | None:
    """The prefix-hit sweep in one table: per hit rate, full transfer against SmartGen (None without a sweep)."""
    points = [i for i, p in enumerate(result.points) if p.prefix_hit is not None]
    if not points:
        return None
    side = result.config.prefix_cache
    table = _table(
        f"prefix hit sweep ({side} cache): ms means as the client saw them; hit: asked (measured share of prompt "
        "tokens the cache held); Δ: the client's TTFT minus the node's, per request, their median; MiB: KV moved per "
        "request; x: TTST speed-up and TBT ratio vs full",
        ["hit", "scheme", "TTFT", "Δ", "TTST", "TBT", "MiB", "TTST x", "TBT x"],
    )
    for index in points:
        point = result.points[index]
        for s in (s for s in summaries if s.point == index and s.scheme in ("full", "smartgen")):
            moved = sum(v for path, v in s.bytes_per_request.items() if path != "metadata")
            table.add_row(
                f"{point.prefix_hit:.0%} ({_measured_hit(result, index, s.scheme)})",
                Text(s.scheme),
                _ms(s.ttft["mean"]),
                _ms1(s.minus_node["ttft"]["p50"]),
                _ms(s.ttst["mean"]),
                _ms(s.tbt["mean"]),
                f"{moved / MIB:.1f}",
                _x(s.vs_full.get("ttst_speedup")),
                _x(s.vs_full.get("tbt")),
            )
    return table


def _measured_hit(result: BenchResult, point: int, scheme: str) -> str:
    """The share of prompt tokens a cache supplied (prefill: not computed; decode: not moved), over measured rounds."""
    requests = [
        r
        for g in result.groups
        if g.point == point and g.scheme == scheme and not g.warmup
        for r in g.requests
        if not r.get("error")
    ]
    prompt = sum(r["prompt_tokens"] for r in requests)
    cached = sum(max(r.get("cached_tokens") or 0, r.get("held_tokens") or 0) for r in requests)
    return f"{cached / prompt:.0%}" if prompt else "-"
