"""The benchmark's load and trace modes: requests sent on their own clock against the decode node's API.

Like `vllm bench serve`: each request is sent at its arrival time on its own thread, whatever the server's state
(Poisson arrivals at a rate for a window, or a trace's arrival times: trace.py), and every request ends as one
record (goodput.py): served, failed with the reason, or refused (a node answered an HTTP error before streaming, or
the bench did not send it). The figures (goodput under the SLOs, throughputs, TTFT / TTST / TBT / TPOT / ITL
percentiles) are goodput.py's, over the run's duration (first request sent to the last one ended). Each request
keeps the node's own figures beside the client's (`node_ttft`, ...).
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from smartgen.apps.bench.config import LoadSpec
from smartgen.apps.bench.goodput import ServeMetrics, SLOs, serve_metrics
from smartgen.apps.bench.percentiles import percentile

__all__ = ["LoadSpec", "LoadRun", "run_load", "replay", "poisson_arrivals", "DROPPED"]

# what a record does not keep of the client's timings: per-token curves (the rounds' CTL figures use them; a load run
# of thousands of requests would carry them for nothing)
DROPPED = ("ctl", "node_ctl", "selection_union_bytes", "selection_counts")
REFUSED = re.compile(r"^HTTP \d{3}: ")  # client.RequestFailed for an error status before the stream began


@dataclass(slots=True)
class LoadRun:
    """One scheme at one point and offered rate, under load: every request's record and what the nodes saw."""

    point: int
    scheme: str
    offered_rate: float | None  # requests per second offered (a trace's: trace.TraceSlice.offered_rate; None: at once)
    window_s: float  # arrival window: from the first arrival to the last (Poisson: the --load-duration)
    wall_s: float  # duration as vLLM's: first request sent to the last one ended
    slos: SLOs
    requests: list[dict[str, Any]] = field(default_factory=list)
    mode: str = "poisson"  # or "trace"
    # watch.py: link utilisation per direction, prefix-cache hit rates per node, mean queueing (Little's law)
    nodes: dict[str, Any] = field(default_factory=dict)
    router: str | None = None  # trace mode over several decode nodes: the router policy that placed the requests

    @property
    def label(self) -> str:
        """The scheme, and the router policy where one placed the requests ("smartgen/cache_aware")."""
        return self.scheme if self.router is None else f"{self.scheme}/{self.router}"

    @property
    def metrics(self) -> ServeMetrics:
        return serve_metrics(self.requests, self.wall_s, self.slos)

    @property
    def arrivals(self) -> int:
        return len(self.requests)

    @property
    def completed(self) -> int:
        return sum(r["outcome"] == "served" for r in self.requests)

    @property
    def failed(self) -> int:
        return sum(r["outcome"] == "failed" for r in self.requests)

    @property
    def refused(self) -> int:
        return sum(r["outcome"] == "refused" for r in self.requests)

    @property
    def goodput(self) -> float:
        """Requests per second (of the run's duration) served within every objective given."""
        return self.metrics.goodput

    @property
    def throughput(self) -> float:
        """Requests per second served, over the run's duration."""
        return self.metrics.request_throughput

    def percentiles(self, key: str) -> dict[str, float | None]:
        values = [float(r[key]) for r in self.requests if r.get(key) is not None]
        return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}

    def ttft_minus_node(self) -> dict[str, float | None]:
        """Per served request, the client's TTFT minus the node's: p50 and max."""
        values = [r["ttft"] - r["node_ttft"] for r in self.requests if _both(r, "ttft")]
        return {"p50": percentile(values, 50), "max": max(values, default=None)}

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "metrics": self.metrics.to_json(), "goodput": self.goodput}


def _both(request: dict[str, Any], key: str) -> bool:
    return request.get(key) is not None and request.get(f"node_{key}") is not None


def poisson_arrivals(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival times (s) at exponential intervals of mean 1 / rate, within [0, duration_s]."""
    arrivals: list[float] = []
    at = 0.0
    while True:
        at += rng.expovariate(rate)
        if at > duration_s:
            return arrivals
        arrivals.append(at)


def _outcome(error: str) -> str:
    return "refused" if REFUSED.match(error) else "failed"


def replay(
    send: Callable[[int], dict[str, Any]],
    arrivals: list[float],
    skipped: dict[int, str] | None = None,
) -> tuple[list[dict[str, Any]], float]:
    """Sends request i at `arrivals[i]` s from now on its own thread (`send(i)` blocks, returns its timings or
    raises); requests in `skipped` are not sent and are recorded refused with that reason. Waits for every one and
    returns (their records in index order, seconds from the start to the last one's end)."""
    skipped = skipped or {}
    records: list[dict[str, Any]] = [{} for _ in arrivals]
    threads = []
    started = time.monotonic()
    ended = [started]
    lock = threading.Lock()

    def one(i: int) -> None:
        sent = time.monotonic() - started
        try:
            timings = send(i)
            entry = {k: v for k, v in timings.items() if k not in DROPPED} | {"outcome": "served", "error": None}
        except Exception as exc:  # a refused or failed request is part of the measurement
            entry = {"outcome": _outcome(str(exc)), "error": str(exc)}
        records[i] = {"index": i, "at": arrivals[i], "sent": sent, **entry}
        with lock:
            ended.append(time.monotonic())

    for i, at in enumerate(arrivals):
        if i in skipped:
            records[i] = {"index": i, "at": at, "sent": None, "outcome": "refused", "error": skipped[i]}
            continue
        time.sleep(max(0.0, started + at - time.monotonic()))
        thread = threading.Thread(target=one, args=(i,), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return records, max(ended) - started


def run_load(
    send: Callable[[int], dict[str, Any]],
    spec: LoadSpec,
    point: int,
    scheme: str,
    seed: int = 0,
) -> LoadRun:
    """Sends requests at Poisson arrivals for `spec.duration_s`; `send(i)` runs request i (blocking) and returns
    its timings (the client's ttft, ttst, tbt, e2e, itl, the node's node_ttft, ...; or raises)."""
    # the same arrivals for every scheme: they are compared on the same offered load
    rng = random.Random(f"smartgen-load:{seed}:{point}:{spec.rate}")
    records, wall = replay(send, poisson_arrivals(spec.rate, spec.duration_s, rng))
    return LoadRun(point, scheme, spec.rate, spec.duration_s, wall, spec.slos(), records)
