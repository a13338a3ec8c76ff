"""Prometheus metrics of one node (`GET /metrics`): a registry per node, the engine's counters read at scrape time.

Names follow what vLLM and SGLang users already chart: a `smartgen:` prefix, seconds and
bytes, `_total` on counters, a `path` label (proactive, full, speculative, fetch_remote,
fetch_local, metadata). Counters are read from the engine's own PathCounters and lane
counters when scraped, so they equal them by construction; histograms are fed by hooks
(every fetch; every finished request). What a router or an autoscaler reads carries vLLM's
own name after the prefix (time_to_first_token_seconds, inter_token_latency_seconds,
request_time_per_output_token_seconds, e2e_request_latency_seconds, num_requests_running,
num_requests_waiting, kv_cache_usage_perc, prompt_tokens_total, generation_tokens_total),
so a query or a KEDA trigger written for vLLM works with the prefix changed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from smartgen.engine.metrics import PATHS, PathCounters, RequestMetrics
from smartgen.lanes.link import LinkEnd
from smartgen.roles.live_state import path_label

__all__ = ["PREFIX", "Peer", "NodeSources", "NodeMetrics", "exposition"]

PREFIX = "smartgen:"
# fetches take a millisecond on loopback and seconds behind a busy paced link
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# a whole request: a short answer on loopback to a long one behind a slow link
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


def _by_label(name: str, documentation: str, label: str, values: dict[str, float]) -> CounterMetricFamily:
    """A counter family with one sample per value of `label`."""
    family = CounterMetricFamily(PREFIX + name, documentation, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value)
    return family


@dataclass(slots=True)
class Peer:
    """One link of this node and the name it is shown under (the prefill node's address, or the decode node's)."""

    name: str
    link: LinkEnd


@dataclass(slots=True)
class NodeSources:
    """Where a node's figures come from, read on every scrape: gauges and totals are name -> (help, value)."""

    role: str  # "decode" | "prefill"
    model: str
    counters: PathCounters
    peers: Callable[[], Sequence[Peer]]
    gauges: Callable[[], dict[str, tuple[str, float]]]
    totals: Callable[[], dict[str, tuple[str, float]]] = dict
    # the node's prefix cache (`PrefixCache.snapshot()`) plus "saved_bytes": {path: KV bytes not transferred}
    prefix: Callable[[], dict[str, Any]] | None = None


def lane_is_up(link: LinkEnd) -> bool:
    """Whether both lanes of a link are open (lanes without a `closed` flag count as open)."""
    return not (getattr(link.push, "closed", False) or getattr(link.control, "closed", False))


class _NodeCollector(Collector):
    """Reads the engine's path counters, the links' lane counters and the node's gauges on every scrape."""

    def __init__(self, sources: NodeSources) -> None:
        self.role, self.model = sources.role, sources.model
        self.counters, self.peers, self.gauges, self.totals = (
            sources.counters,
            sources.peers,
            sources.gauges,
            sources.totals,
        )
        self.prefix = sources.prefix

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            PREFIX + "node_info", "The node's role and model (always 1).", labels=["role", "model"]
        )
        info.add_metric([self.role, self.model], 1)
        yield info
        yield from self._paths()
        yield from self._links()
        for name, (doc, value) in self.gauges().items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        for name, (doc, value) in self.totals().items():
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        if self.prefix is not None:
            yield from self._prefix(self.prefix())

    @staticmethod
    def _prefix(snap: dict[str, Any]) -> Iterator[Metric]:
        name = PREFIX + "prefix_cache_"
        yield GaugeMetricFamily(name + "bytes", "KV bytes the prefix cache holds.", value=snap["bytes"])
        yield GaugeMetricFamily(name + "budget_bytes", "The prefix cache's byte budget.", value=snap["budget_bytes"])
        yield GaugeMetricFamily(name + "blocks", "Token blocks the prefix cache holds.", value=snap["blocks"])
        yield GaugeMetricFamily(
            name + "hit_ratio", "Share of looked-up prompt tokens found cached.", value=snap["hit_rate"]
        )
        yield CounterMetricFamily(name + "lookup_tokens", "Prompt tokens looked up.", value=snap["lookup_tokens"])
        yield CounterMetricFamily(name + "hit_tokens", "Prompt tokens found cached.", value=snap["hit_tokens"])
        yield CounterMetricFamily(name + "evicted_blocks", "Blocks evicted (LRU).", value=snap["evicted_blocks"])
        saved = CounterMetricFamily(
            PREFIX + "prefix_saved_bytes",
            "KV bytes not transferred thanks to a prefix cache, per path.",
            labels=["path"],
        )
        for path, value in snap["saved_bytes"].items():
            saved.add_metric([path_label(path)], value)
        yield saved

    def _paths(self) -> Iterator[Metric]:
        snap = self.counters.snapshot()
        families = {
            "bytes": CounterMetricFamily(
                PREFIX + "kv_transfer_bytes",
                "KV bytes moved (sent, or gathered for fetch_local) per path.",
                labels=["path"],
            ),
            "seconds": CounterMetricFamily(
                PREFIX + "kv_transfer_seconds",
                "Time spent moving KV per path (fetch round trips, local gathers).",
                labels=["path"],
            ),
            "transfers": CounterMetricFamily(
                PREFIX + "kv_transfers", "Transfers per path (push batches, fetches, gathers).", labels=["path"]
            ),
            "failed": CounterMetricFamily(
                PREFIX + "kv_failed_transfers", "Transfers that did not complete per path.", labels=["path"]
            ),
        }
        for key, family in families.items():
            for path in PATHS:
                family.add_metric([path_label(path)], snap[key][path])
            yield family
        yield CounterMetricFamily(
            PREFIX + "kv_selected_entries",
            "KV entries the selectors picked (decode node).",
            value=snap["selected_entries"],
        )
        yield CounterMetricFamily(
            PREFIX + "kv_remote_entries",
            "Selected KV entries that were remote and fetched.",
            value=snap["remote_entries"],
        )
        yield _by_label(
            "deferred_steps",
            "Decode steps taken back and redone (decode node), by why: share (its fetches held the batch past its "
            "share of the step; it stays in the batch) or stall (a fetch not back within --fetch-stall-ms; it parks).",
            "reason",
            snap["deferred_steps"],
        )
        yield _by_label(
            "fetch_wait_seconds",
            "Decode steps' time waiting for fetch replies (decode node), by the kind waited for: step (its own "
            "fetch), prefetch (asked a layer ahead) or forecast (a joining request's first step).",
            "kind",
            {kind: fetches["waited"] for kind, fetches in snap["fetches"].items()},
        )
        yield GaugeMetricFamily(
            PREFIX + "on_demand_ratio",
            "Share of selected entries fetched remotely, since start.",
            value=snap["on_demand_ratio"],
        )

    def _links(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(PREFIX + "link_up", "1 while the link to a peer is open, else 0.", labels=["peer"])
        sent = CounterMetricFamily(PREFIX + "lane_sent_bytes", "Bytes sent per lane.", labels=["peer", "lane"])
        busy = CounterMetricFamily(PREFIX + "lane_busy_seconds", "Time a lane spent sending.", labels=["peer", "lane"])
        messages = CounterMetricFamily(PREFIX + "lane_messages", "Messages sent per lane.", labels=["peer", "lane"])
        descriptors = CounterMetricFamily(
            PREFIX + "kv_descriptors_posted", "One-sided write descriptors posted (after coalescing).", labels=["peer"]
        )
        batches = CounterMetricFamily(PREFIX + "kv_write_batches", "Write batches posted.", labels=["peer"])
        for peer in self.peers():
            up.add_metric([peer.name], 1.0 if lane_is_up(peer.link) else 0.0)
            posted = 0
            for lane_name, lane in (("push", peer.link.push), ("control", peer.link.control)):
                counts = lane.counters.snapshot()
                sent.add_metric([peer.name, lane_name], counts["bytes_sent"])
                busy.add_metric([peer.name, lane_name], counts["busy_seconds"])
                messages.add_metric([peer.name, lane_name], counts["num_messages"])
                posted += counts["num_descriptors"]
            descriptors.add_metric([peer.name], posted)
            batches.add_metric([peer.name], peer.link.push.counters.snapshot()["num_batches"])
        yield from (up, sent, busy, messages, descriptors, batches)


class NodeMetrics:
    """A node's own CollectorRegistry (never the global one: tests run several nodes in one process)."""

    def __init__(self, sources: NodeSources) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_NodeCollector(sources))
        self.fetch_latency = self._histogram(
            "kv_fetch_latency_seconds", "On-demand fetch round trip, FETCH sent to reply landed."
        )
        sources.counters.observe(self._on_transfer)
        if sources.role != "decode":
            return
        self.ttft = self._histogram("time_to_first_token_seconds", "TTFT from arrival.", TOKEN_BUCKETS)
        self.ttst = self._histogram(
            "time_to_second_token_seconds", "TTST from arrival (includes the stage-transition stall).", TOKEN_BUCKETS
        )
        self.tbt = self._histogram("time_between_tokens_seconds", "Gaps between consecutive tokens after the second.")
        self.itl = self._histogram(
            "inter_token_latency_seconds",
            "Gaps between consecutive tokens, the first (the stage-transition stall) included, as vLLM's.",
        )
        self.tpot = self._histogram(
            "request_time_per_output_token_seconds", "Per request: first to last token over the tokens after the first."
        )
        self.e2e = self._histogram(
            "e2e_request_latency_seconds",
            "Arrival to end of every request the engine took, whatever its end.",
            REQUEST_BUCKETS,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of the requests the engine took.", registry=self.registry
        )
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", registry=self.registry)
        self.finished = Counter(
            PREFIX + "requests_finished", "Requests ended, by reason.", ["reason"], registry=self.registry
        )
        self.aborted = Counter(
            PREFIX + "requests_aborted",
            "Requests aborted or failed (client gone, peer lost, error).",
            registry=self.registry,
        )

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
        return Histogram(PREFIX + name, doc, buckets=buckets, registry=self.registry)

    def _on_transfer(self, path: str, num_bytes: int, seconds: float) -> None:
        if path == "on_demand" and seconds > 0:  # the decode side times fetches; the prefill side only counts bytes
            self.fetch_latency.observe(seconds)

    def request_finished(self, reason: str, metrics: RequestMetrics | None) -> None:
        """The scheduler's finish hook, called as a request ends: its latencies and token counts, its end reason.
        A request refused or failed before the engine took it (`metrics` None) counts only by its reason."""
        self.finished.labels(reason).inc()
        if reason in ("aborted", "error", "overloaded", "unavailable", "timeout"):
            self.aborted.inc()
        if metrics is None:
            return
        self.e2e.observe(max(0.0, time.monotonic() - metrics.created))
        times = metrics.token_times
        self.prompt_tokens.inc(metrics.prompt_tokens)
        self.generation_tokens.inc(len(times))
        if metrics.ttft is not None:
            self.ttft.observe(metrics.ttft)
        if metrics.ttst is not None:
            self.ttst.observe(metrics.ttst)
        for index, (before, after) in enumerate(zip(times, times[1:])):
            self.itl.observe(after - before)
            if index:  # TBT leaves out the stall before the second token
                self.tbt.observe(after - before)
        if len(times) > 1:
            self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The registry in the Prometheus text format, and its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
