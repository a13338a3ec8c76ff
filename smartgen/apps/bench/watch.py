"""What the nodes saw during a load or trace run: link bytes per direction, prefix-cache hits, mean queueing.

Counters are read from every node's /status before and after the run (their differences are the run's); the
queues are sampled from the nodes' /metrics every SAMPLE_S while it runs:

- link utilisation per direction: bytes the prefill nodes sent (KV, replies: the decode node's ingress) and bytes
  the decode node sent back (requests, fetches, notices), each over (link rate x duration x number of links);
- prefix-cache hit rate per side: hit tokens / looked-up prompt tokens of the run (prefill nodes summed: their
  hits skip prefill; the decode node's skip transfer);
- mean queueing by Little's law, time-averaged queue length / arrival rate: on the decode node, requests waiting
  for a KV pool slot (`num_requests_waiting`); on the prefill nodes, opened requests waiting for prefill
  (`requests_queued`). The nodes do not report a request's own queueing time, so this is a mean over requests.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from smartgen.lanes.rate import bytes_per_second

__all__ = ["NodeWatch", "read_gauges", "cache_counts", "statuses", "read_link", "served_model", "num_links", "SAMPLE_S"]

SAMPLE_S = 0.25
DECODE_QUEUE = "smartgen:num_requests_waiting"
PREFILL_QUEUE = "smartgen:requests_queued"


def read_gauges(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Values of unlabelled Prometheus samples `names` in an exposition text (absent ones left out)."""
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            values[name] = float(value)
    return values


def cache_counts(status: dict[str, Any]) -> dict[str, float]:
    """Looked-up and hit prompt tokens of the decode nodes' prefix caches and of the prefill nodes' (each side
    summed), and link bytes each way, from LocalCluster.status() or `statuses` (a list of decode nodes)."""
    counts = dict.fromkeys(("decode_lookup", "decode_hit", "prefill_lookup", "prefill_hit", "ingress", "egress"), 0.0)
    decodes = status["decode"] if isinstance(status["decode"], list) else [status["decode"]]
    for decode in decodes:  # several behind a router: summed, as the prefill nodes are
        cache = decode.get("prefix_cache") or {}
        counts["decode_lookup"] += cache.get("lookup_tokens", 0)
        counts["decode_hit"] += cache.get("hit_tokens", 0)
        for link in decode.get("links", []):
            counts["egress"] += link["push"]["bytes_sent"] + link["control"]["bytes_sent"]
    for node in status["prefill"]:
        cache = node.get("prefix_cache") or {}
        counts["prefill_lookup"] += cache.get("lookup_tokens", 0)
        counts["prefill_hit"] += cache.get("hit_tokens", 0)
        for link in node.get("links", []):
            counts["ingress"] += link["push"]["bytes_sent"] + link["control"]["bytes_sent"]
    return counts


@dataclass(slots=True)
class NodeWatch:
    """Samples a LocalCluster's queues from `start()` to `stop()`; `stop` returns what the nodes saw."""

    cluster: Any  # LocalCluster: .urls (every decode node), .prefill_status
    link_gbps: float | None
    num_links: int = 1
    _before: dict[str, float] = field(default_factory=dict)
    _area: dict[str, float] = field(default_factory=lambda: {"decode": 0.0, "prefill": 0.0})
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _samples: int = 0

    def start(self) -> NodeWatch:
        self._before = cache_counts(statuses(self.cluster))
        self._thread = threading.Thread(target=self._run, name="bench-node-watch", daemon=True)
        self._thread.start()
        return self

    def _queues(self) -> dict[str, float]:
        decode = sum(
            read_gauges(_get(f"{url}/metrics"), (DECODE_QUEUE,)).get(DECODE_QUEUE, 0.0)
            for url in decode_urls(self.cluster)
        )
        prefill = sum(
            read_gauges(_get(f"http://{address}/metrics"), (PREFILL_QUEUE,)).get(PREFILL_QUEUE, 0.0)
            for address in self.cluster.prefill_status
        )
        return {"decode": decode, "prefill": prefill}

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(SAMPLE_S):
            try:
                queues = self._queues()
            except OSError:  # a node busy past the timeout: this sample is lost, the next one counts its time
                continue
            now = time.monotonic()
            for side, length in queues.items():
                self._area[side] += length * (now - last)  # the queue as sampled now, held since the last sample
            last = now
            self._samples += 1

    def stop(self, duration_s: float, arrivals: int) -> dict[str, Any]:
        """Ends sampling; the run's figures (see the module's docstring), None where not measurable."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        after = cache_counts(statuses(self.cluster))
        delta = {key: after[key] - self._before.get(key, 0.0) for key in after}
        capacity = (
            bytes_per_second(self.link_gbps) * duration_s * self.num_links
            if self.link_gbps and duration_s > 0
            else None
        )
        return {
            "link_bytes": delta["ingress"],
            "link_bytes_back": delta["egress"],
            "link_utilisation": delta["ingress"] / capacity if capacity else None,
            "link_utilisation_back": delta["egress"] / capacity if capacity else None,
            "prefix_lookup_tokens": {"prefill": delta["prefill_lookup"], "decode": delta["decode_lookup"]},
            "prefix_hit_tokens": {"prefill": delta["prefill_hit"], "decode": delta["decode_hit"]},
            "prefix_hit_rate": {
                side: delta[f"{side}_hit"] / delta[f"{side}_lookup"] if delta[f"{side}_lookup"] else None
                for side in ("prefill", "decode")
            },
            "queue_s": {side: area / arrivals if arrivals else None for side, area in self._area.items()},
            "queue_samples": self._samples,
        }


def statuses(cluster: Any) -> dict[str, Any]:
    """Every decode node's /status (a list) and every prefill node's, of a LocalCluster."""
    return {
        "decode": [json.loads(_get(f"{url}/status", 30.0)) for url in decode_urls(cluster)],
        "prefill": [json.loads(_get(f"http://{address}/status", 30.0)) for address in cluster.prefill_status],
    }


def read_link(url: str) -> dict[str, Any]:
    """A decode node's /status "link": which pacing applies to what it receives (the regime line says it)."""
    return dict(json.loads(_get(f"{url}/status", 30.0)).get("link") or {})


def served_model(url: str) -> str:
    """The model name a decode node serves (its /v1/models), which requests through the router must name."""
    return str(json.loads(_get(f"{url}/v1/models", 30.0))["data"][0]["id"])


def num_links(config: Any, point: Any) -> int:
    """Paced links the KV crosses at the regime's rate (BenchConfig, Point): one shared ingress per decode node,
    else one per prefill node; NodeWatch's link utilisation is over their capacity."""
    return config.decode_nodes if config.shared_link else point.prefill_nodes


def decode_urls(cluster: Any) -> list[str]:
    """Every decode node's base URL (a colocated `serve --role both` cluster lists none: its one URL)."""
    return list(cluster.urls) or [cluster.url]


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()
