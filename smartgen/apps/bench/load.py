"""The benchmark's load mode: Poisson arrivals against the decode node's HTTP API, and goodput under SLOs.

Like `vllm bench serve`: requests arrive at exponential intervals (mean 1 / rate) for a fixed window,
each on its own thread, whatever the server's state; a request counts towards goodput when it
finished and met both objectives (TTFT, and its mean TBT, as the streaming client saw them). Goodput and
throughput are per second of the arrival window and of the whole run. Each request keeps the node's own figures
beside the client's (`node_ttft`, ...).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from smartgen.apps.bench.config import LoadSpec
from smartgen.apps.bench.stats import percentile

__all__ = ["LoadSpec", "LoadRun", "run_load", "KEPT"]

# what each request keeps of its timings: the client's, then the node's own
KEPT = ("ttft", "ttst", "tbt", "e2e", "node_ttft", "node_ttst", "node_tbt")


@dataclass(slots=True)
class LoadRun:
    """One scheme at one point under load."""

    point: int
    scheme: str
    offered_rate: float
    arrivals: int
    completed: int
    failed: int
    met_slo: int
    window_s: float
    wall_s: float
    requests: list[dict[str, Any]] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        """Requests per second (of the arrival window) that finished within both objectives."""
        return self.met_slo / self.window_s

    @property
    def throughput(self) -> float:
        """Requests per second finished, over the whole run (the last one may finish after the window)."""
        return self.completed / self.wall_s if self.wall_s > 0 else 0.0

    def percentiles(self, key: str) -> dict[str, float | None]:
        values = [float(r[key]) for r in self.requests if r.get(key) is not None]
        return {"p50": percentile(values, 50), "p99": percentile(values, 99)}

    def ttft_minus_node(self) -> dict[str, float | None]:
        """Per finished request, the client's TTFT minus the node's: p50 and max."""
        values = [r["ttft"] - r["node_ttft"] for r in self.requests if _both(r, "ttft")]
        return {"p50": percentile(values, 50), "max": max(values, default=None)}


def _both(request: dict[str, Any], key: str) -> bool:
    return request.get(key) is not None and request.get(f"node_{key}") is not None


def run_load(
    send: Callable[[int], dict[str, Any]],
    spec: LoadSpec,
    point: int,
    scheme: str,
    seed: int = 0,
) -> LoadRun:
    """Sends requests at Poisson arrivals for `spec.duration_s`; `send(i)` runs request i (blocking) and returns
    its timings (KEPT: the client's ttft, ttst, tbt, e2e, the node's node_ttft, ...; or raises). Waits for every
    request to end."""
    rng = random.Random(f"smartgen-load:{seed}:{scheme}:{point}")
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    threads = []

    def one(i: int) -> None:
        try:
            timings = send(i)
            entry = {**{key: timings.get(key) for key in KEPT}, "error": None}
        except Exception as exc:  # a refused or failed request is part of the measurement
            entry = {**dict.fromkeys(KEPT), "error": str(exc)}
        with lock:
            results.append(entry)

    started = time.monotonic()
    at = started
    i = 0
    while True:
        at += rng.expovariate(spec.rate)
        if at - started > spec.duration_s:
            break
        time.sleep(max(0.0, at - time.monotonic()))
        thread = threading.Thread(target=one, args=(i,), daemon=True)
        thread.start()
        threads.append(thread)
        i += 1
    for thread in threads:
        thread.join()
    wall = time.monotonic() - started
    done = [r for r in results if r["error"] is None]
    met = [
        r
        for r in done
        if r["ttft"] is not None and r["ttft"] <= spec.slo_ttft_s and (r["tbt"] is None or r["tbt"] <= spec.slo_tbt_s)
    ]
    return LoadRun(
        point=point,
        scheme=scheme,
        offered_rate=spec.rate,
        arrivals=len(threads),
        completed=len(done),
        failed=len(results) - len(done),
        met_slo=len(met),
        window_s=spec.duration_s,
        wall_s=wall,
        requests=results,
    )
