"""A node's monitoring: its Prometheus registry, its throughput history, and what it adds to /status."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from smartgen.engine.decode import DecodeEngine, RequestFailed
from smartgen.engine.prefill import PrefillEngine
from smartgen.lanes.link import LinkEnd
from smartgen.roles.live_state import RateHistory, block_map, path_label
from smartgen.roles.prometheus import NodeMetrics, NodeSources, Peer, exposition, lane_is_up

__all__ = ["NodeMonitoring", "decode_monitoring", "prefill_monitoring"]


class NodeMonitoring:
    """Counters sampled once a second for the last minute; `decorate` adds them (and more) to a status snapshot."""

    def __init__(self, sources: NodeSources, interval_s: float = 1.0) -> None:
        self.role = sources.role
        self.counters = sources.counters
        self.peers = sources.peers
        self.metrics = NodeMetrics(sources)
        self.prefix = sources.prefix
        self.request_maps: Callable[[str, int], list[str]] | None = None  # decode: (request id, length) -> maps
        self.history = RateHistory(self._cumulative, interval_s=interval_s).start()

    def _cumulative(self) -> dict[str, float]:
        snap = self.counters.snapshot()
        values = {f"path:{path_label(p)}": float(b) for p, b in snap["bytes"].items()}
        for peer in self.peers():
            for lane_name, lane in (("push", peer.link.push), ("control", peer.link.control)):
                counts = lane.counters.snapshot()
                values[f"lane:{peer.name}:{lane_name}:bytes"] = float(counts["bytes_sent"])
                values[f"lane:{peer.name}:{lane_name}:busy"] = float(counts["busy_seconds"])
        return values

    def throughput(self) -> dict[str, Any]:
        """Per path and per lane: bytes per second over the last minute (newest last), lane busy share."""
        series = self.history.series()
        lanes = []
        for peer in self.peers():
            for lane_name in ("push", "control"):
                key = f"lane:{peer.name}:{lane_name}"
                lanes.append(
                    {
                        "peer": peer.name,
                        "lane": lane_name,
                        "bytes_per_s": series.get(f"{key}:bytes", []),
                        "busy": series.get(f"{key}:busy", []),  # seconds busy per second: link utilisation
                    }
                )
        paths = {name[len("path:") :]: rates for name, rates in series.items() if name.startswith("path:")}
        return {"interval_s": self.history.interval_s, "paths": paths, "lanes": lanes}

    def decorate(self, snapshot: dict[str, Any]) -> None:
        """Adds peers, throughput series and (decode) each request's down-sampled block maps to `snapshot`."""
        snapshot["peers"] = [{"name": p.name, "up": lane_is_up(p.link)} for p in self.peers()]
        snapshot["throughput"] = self.throughput()
        if self.prefix is not None:
            snapshot["prefix_cache"] = self.prefix()
        if self.request_maps is not None:
            for entry in snapshot.get("requests", []):
                entry["block_maps"] = self.request_maps(entry["request_id"], int(entry["prompt_tokens"]))

    def exposition(self) -> tuple[bytes, str]:
        return exposition(self.metrics.registry)

    def close(self) -> None:
        self.history.close()


def decode_monitoring(
    engine: DecodeEngine, scheduler: Any, links: Sequence[LinkEnd], names: Sequence[str], model: str
) -> NodeMonitoring:
    """Monitoring of a decode node; hooks the scheduler's finish and status hooks."""
    peers = [Peer(name, link) for name, link in zip(names, links)]

    def gauges() -> dict[str, tuple[str, float]]:
        health = scheduler.health()
        slots = engine.pool.num_slots
        used = slots - engine.pool.num_free
        usage = used / slots if slots else 0.0
        holding = health["running"] + health["prefilling"] + health["parked"]
        return {
            "requests_running": ("Requests decoding.", health["running"]),
            "requests_prefilling": ("Requests dispatched and waiting for their first token.", health["prefilling"]),
            "requests_waiting": ("Requests queued for a pool slot.", health["waiting"]),
            "pool_slots": ("KV pool slots.", slots),
            "pool_slots_used": ("KV pool slots in use.", used),
            "pool_usage_ratio": ("Share of KV pool slots in use.", usage),
            # vLLM's names, which routers and autoscalers read: running = holding a slot (prefilling, decoding or
            # parked for a late fetch), waiting = queued for one; KV usage is the share of pool slots in use
            "num_requests_running": ("Requests holding a KV pool slot (prefilling, decoding or parked).", holding),
            "num_requests_waiting": ("Requests queued for a KV pool slot.", health["waiting"]),
            "kv_cache_usage_perc": ("Share of KV pool slots in use (0 to 1, as vLLM's).", usage),
        }

    def maps(request_id: str, length: int) -> list[str]:
        try:
            slot = engine.slot_of(request_id)
        except (KeyError, RequestFailed):  # finished or failing while the snapshot is taken
            return []
        masks = engine.pool.masks.token_states(slot, length)  # [L, n]: one copy, not one per layer
        return [block_map(row) for row in masks]

    def prefix() -> dict[str, Any]:
        # a held token would otherwise have crossed the link by some path; the decode node cannot say which
        return {**engine.prefix_cache.snapshot(), "saved_bytes": {"held": engine.held_bytes}}

    monitoring = NodeMonitoring(NodeSources("decode", model, engine.counters, lambda: peers, gauges, prefix=prefix))
    monitoring.request_maps = maps
    scheduler.finish_listeners.append(monitoring.metrics.request_finished)
    scheduler.status_hooks.append(monitoring.decorate)
    return monitoring


def prefill_monitoring(
    engine: PrefillEngine, model: str, num_prefilled: Callable[[], int], head_start: Callable[[], tuple[int, int]]
) -> NodeMonitoring:
    """Monitoring of a prefill node: store occupancy, queue, pushes per path; peers are the decode nodes.
    `head_start()`: (tokens this node decoded ahead of decode nodes, decode steps it gave up for a waiting prompt)."""

    def peers() -> list[Peer]:
        return [Peer(f"decode-{i + 1}", link) for i, link in enumerate(engine.links)]

    def gauges() -> dict[str, tuple[str, float]]:
        return {
            "prefill_store_requests": ("Requests whose KV the prefill store holds.", engine.store.num_requests),
            "prefill_store_bytes": ("KV bytes the prefill store holds.", engine.store.bytes_held),
            "requests_open": ("Requests open on this prefill node.", engine.num_open),
            "requests_queued": ("Opened requests waiting for prefill.", engine.num_queued),
        }

    def totals() -> dict[str, tuple[str, float]]:
        return {
            "requests_prefilled": ("Requests prefilled.", num_prefilled()),
            "head_start_tokens": ("Tokens this node decoded ahead of a decode node while idle.", head_start()[0]),
            "decode_steps_yielded": (
                "Decode steps this node gave up for a prompt waiting for prefill (head start, forecast).",
                head_start()[1],
            ),
            "kv_crossed_twice_bytes": (
                "KV bytes fetches sent that a push had already put on the link (they crossed twice).",
                sum(engine.crossed_twice.snapshot()["bytes"].values()),
            ),
        }

    def prefix() -> dict[str, Any]:
        saved = engine.held_saved.snapshot()["bytes"]
        return {**engine.prefix_cache.snapshot(), "saved_bytes": {path: b for path, b in saved.items() if b}}

    return NodeMonitoring(NodeSources("prefill", model, engine.counters, peers, gauges, totals, prefix))
