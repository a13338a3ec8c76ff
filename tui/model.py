"""The dashboard's data model: frames of node snapshots in, rows the screens show out (no Textual here)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Frame",
    "DashboardModel",
    "RequestRow",
    "MaskRow",
    "PathRate",
    "LinkUse",
    "PeerRow",
    "NodeSummary",
    "downsample",
    "PATH_ORDER",
]

# what the lanes panel lists, in this order; pushes come from prefill nodes, fetches from the decode node
PATH_ORDER = ("proactive", "full", "speculative", "fetch_remote", "fetch_local")
PUSH_PATHS = ("proactive", "full", "speculative", "metadata")
FINISHED_KEEP = 20  # finished requests kept in the table


@dataclass(slots=True)
class Frame:
    """One moment of a deployment: the decode node's /status and each prefill node's (any may be missing)."""

    t: float
    decode: dict[str, Any] | None = None
    prefill: list[dict[str, Any]] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # where the snapshots came from, for the peers strip

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Frame:
        """A recorded line: a frame ({"t", "decode", "prefill"}) or a bare node snapshot (with "role")."""
        if "role" in record:
            role = record["role"]
            return cls(time.time(), record if role == "decode" else None, [] if role == "decode" else [record])
        return cls(float(record.get("t", 0.0)), record.get("decode"), list(record.get("prefill") or []))


@dataclass(slots=True)
class RequestRow:
    request_id: str
    prompt_tokens: int | None
    scheme: str
    state: str
    ttft: float | None
    ttst: float | None
    tbt: float | None
    tokens: int | None
    on_demand_ratio: float | None
    active: bool


@dataclass(slots=True)
class MaskRow:
    layer: int
    cells: str  # MAP_CHARS: L local, R remote, M mixed, . padding
    local: int
    remote: int


@dataclass(slots=True)
class PathRate:
    path: str
    series: list[float]  # bytes per second, oldest first
    current: float | None  # None: no node in view reports this path


@dataclass(slots=True)
class LinkUse:
    name: str
    series: list[float]  # busy seconds per second (0..1)
    up: bool


@dataclass(slots=True)
class PeerRow:
    name: str
    role: str
    up: bool
    detail: str


@dataclass(slots=True)
class NodeSummary:
    """The decode node a model watches: lost (its last poll failed), ready, not ready, or waiting (no frame yet)."""

    state: str
    running: int | None
    waiting: int | None
    finished: int  # requests seen finishing (the table keeps the last FINISHED_KEEP)


def downsample(cells: str, width: int) -> str:
    """Merges a block map into at most `width` cells: local only if every merged cell is local."""
    n = len(cells)
    if width <= 0:
        return ""
    if n <= width:
        return cells
    out = []
    for i in range(width):
        group = set(cells[i * n // width : (i + 1) * n // width]) - {"."}
        out.append("." if not group else group.pop() if len(group) == 1 else "M")
    return "".join(out)


def _sum_series(series: list[list[float]]) -> list[float]:
    """Element-wise sum, aligned on the newest sample (series may differ in length)."""
    length = max((len(s) for s in series), default=0)
    out = [0.0] * length
    for s in series:
        for i, value in enumerate(s):
            out[length - len(s) + i] += value
    return out


class DashboardModel:
    """Holds the latest frame, the selection and the connection state; derives everything the screens draw."""

    def __init__(self) -> None:
        self.frame: Frame | None = None
        self.selected_id: str | None = None
        self.selected_layer = 0
        self.paused = False
        self.error: str | None = None  # the last poll failed: why
        self.lost_since: float | None = None
        self._maps: dict[str, list[str]] = {}  # last block maps seen per request: a finished one keeps its rows
        self._finished: dict[str, RequestRow] = {}
        self._ratios: dict[str, float] = {}  # the on-demand ratio a request had when last seen active

    # -- input -------------------------------------------------------------------------
    def update(self, frame: Frame) -> None:
        self.frame, self.error, self.lost_since = frame, None, None
        decode = frame.decode or {}
        for entry in decode.get("requests", []):
            if entry.get("block_maps"):
                self._maps[entry["request_id"]] = list(entry["block_maps"])
            if entry.get("on_demand_ratio") is not None:
                self._ratios[entry["request_id"]] = entry["on_demand_ratio"]
        for entry in decode.get("recent", []):
            row = self._finished[entry["request_id"]] = _finished_row(entry)
            if row.on_demand_ratio is None:  # a node that does not report it at the finish: the last value seen
                row.on_demand_ratio = self._ratios.get(row.request_id)
        while len(self._finished) > FINISHED_KEEP:
            self._finished.pop(next(iter(self._finished)))
        shown = {r.request_id for r in self.requests()}
        for stale in set(self._maps) - shown:
            del self._maps[stale]
        for stale in set(self._ratios) - shown:
            del self._ratios[stale]
        if self.selected_id is None or self.selected_id not in {r.request_id for r in self.requests()}:
            active = [r for r in self.requests() if r.active]
            self.selected_id = active[-1].request_id if active else self.selected_id

    def connection_lost(self, error: str) -> None:
        if self.lost_since is None:
            self.lost_since = time.monotonic()
        self.error = error

    # -- selection ---------------------------------------------------------------------
    def select(self, step: int) -> None:
        """Moves the selection `step` rows down (negative: up) the request table, wrapping."""
        ids = [r.request_id for r in self.requests()]
        if not ids:
            return
        at = ids.index(self.selected_id) if self.selected_id in ids else -1
        self.selected_id = ids[(at + step) % len(ids)]

    def select_layer(self, step: int) -> None:
        layers = len(self.mask_rows(1))
        if layers:
            self.selected_layer = (self.selected_layer + step) % layers

    # -- what the screens show ---------------------------------------------------------
    def requests(self) -> list[RequestRow]:
        """Active requests (oldest first), then finished ones (newest first)."""
        decode = (self.frame.decode if self.frame else None) or {}
        active = [_active_row(e) for e in decode.get("requests", [])]
        seen = {r.request_id for r in active}
        done = [r for rid, r in reversed(self._finished.items()) if rid not in seen]
        return active + done

    def selected(self) -> RequestRow | None:
        return next((r for r in self.requests() if r.request_id == self.selected_id), None)

    def mask_rows(self, width: int) -> list[MaskRow]:
        """The selected request's layers, each block map down-sampled to `width` cells."""
        maps = self._maps.get(self.selected_id or "", [])
        return [MaskRow(i, downsample(m, width), m.count("L"), m.count("R") + m.count("M")) for i, m in enumerate(maps)]

    def layer_detail(self) -> dict[str, Any] | None:
        """The selected layer at full /status resolution, with its entry counts."""
        maps = self._maps.get(self.selected_id or "", [])
        if not maps or self.selected_layer >= len(maps):
            return None
        decode = (self.frame.decode if self.frame else None) or {}
        entry = next((e for e in decode.get("requests", []) if e["request_id"] == self.selected_id), None)
        counts = (entry or {}).get("masks") or []
        layer = counts[self.selected_layer] if self.selected_layer < len(counts) else None
        return {"layer": self.selected_layer, "cells": maps[self.selected_layer], "counts": layer}

    def path_rates(self) -> list[PathRate]:
        out = []
        for path in PATH_ORDER:
            sources = self._path_sources(path)
            series = _sum_series([s["throughput"]["paths"].get(path, []) for s in sources])
            current = (series[-1] if series else 0.0) if sources else None
            out.append(PathRate(path, series, current))
        return out

    def _path_sources(self, path: str) -> list[dict[str, Any]]:
        """The snapshots that count `path` (pushes on prefill nodes, fetches on the decode node)."""
        frame = self.frame
        if frame is None:
            return []
        prefill = [s for s in frame.prefill if "throughput" in s]
        decode = [frame.decode] if frame.decode and "throughput" in frame.decode else []
        if path in PUSH_PATHS:
            return prefill
        return decode or (prefill if path == "fetch_remote" else [])

    def link_use(self) -> list[LinkUse]:
        """Busy share of each link, from the sending side (prefill nodes when in view, else the decode node)."""
        frame = self.frame
        if frame is None:
            return []
        senders = [s for s in frame.prefill if "throughput" in s] or (
            [frame.decode] if frame.decode and "throughput" in frame.decode else []
        )
        out = []
        for snap in senders:
            up = {p["name"]: p["up"] for p in snap.get("peers", [])}
            by_peer: dict[str, list[list[float]]] = {}
            for lane in snap["throughput"].get("lanes", []):
                by_peer.setdefault(lane["peer"], []).append(lane["busy"])
            for peer, series in by_peer.items():
                busy = [min(1.0, v) for v in _sum_series(series)]
                out.append(LinkUse(peer, busy, up.get(peer, True)))
        return out

    def node(self) -> NodeSummary:
        """This model's decode node at a glance, for the nodes strip of a several-node dashboard."""
        decode = (self.frame.decode if self.frame else None) or {}
        health = decode.get("health") or {}
        running = sum(int(health.get(k, 0)) for k in ("running", "prefilling", "parked")) if health else None
        waiting = int(health.get("waiting", 0)) if health else None
        if self.error is not None:
            state = "lost"
        elif self.frame is None:
            state = "waiting"
        else:
            state = "ready" if health.get("ready", True) else "not ready"
        return NodeSummary(state, running, waiting, len(self._finished))

    def peers(self) -> list[PeerRow]:
        frame = self.frame
        if frame is None:
            return []
        rows = []
        if frame.decode is not None:
            h = frame.decode.get("health", {})
            detail = f"{h.get('running', 0)}+{h.get('prefilling', 0)} run {h.get('waiting', 0)} wait"
            rows.append(PeerRow("decode", "decode", bool(h.get("ready", True)), detail))
            for peer in frame.decode.get("peers", []):
                rows.append(PeerRow(peer["name"], "link", peer["up"], ""))
        for i, snap in enumerate(frame.prefill):
            mib = snap.get("bytes_held", 0) / 2**20
            detail = f"{snap.get('requests_held', 0)} held {mib:.1f}MiB"
            rows.append(PeerRow(f"prefill-{i + 1}:", "prefill", True, detail))
        return rows


def _active_row(e: dict[str, Any]) -> RequestRow:
    return RequestRow(
        e["request_id"],
        e.get("prompt_tokens"),
        e.get("scheme") or "-",
        e.get("state", "?"),
        e.get("ttft"),
        e.get("ttst"),
        e.get("tbt"),
        e.get("output_tokens"),
        e.get("on_demand_ratio"),
        True,
    )


def _finished_row(e: dict[str, Any]) -> RequestRow:
    state = e.get("finish_reason") or "finished"
    return RequestRow(
        e["request_id"],
        e.get("prompt_tokens"),
        e.get("scheme") or "-",
        "finished" if state in ("stop", "length") else state,
        e.get("ttft"),
        e.get("ttst"),
        e.get("tbt"),
        e.get("completion_tokens"),
        e.get("on_demand_ratio"),  # the request's final ratio, which the decode node now reports at the finish
        False,
    )
