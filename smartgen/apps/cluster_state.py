"""Each process of a running local cluster as one row: ready, not ready or lost, and its running and waiting requests.

A decode node answers /health (200 ready, 503 not ready: no live prefill node, or stopping); a prefill node /status
(the requests it prefills and holds); the router /workers (the nodes it routes to, and which of them it finds
healthy). A process that exited is "lost" whatever its last answer was.
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

__all__ = ["NodeState", "node_state", "READY", "NOT_READY", "LOST", "NO_ANSWER"]

READY, NOT_READY, LOST, NO_ANSWER = "ready", "not ready", "lost", "no answer"
TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class NodeState:
    """One row of the cluster table; `running`/`waiting` are None where the process does not say."""

    name: str
    role: str  # prefill, decode or router
    url: str
    state: str  # READY, NOT_READY, LOST or NO_ANSWER
    running: int | None = None
    waiting: int | None = None
    detail: str = ""


def _get(url: str) -> dict[str, Any]:
    """The JSON at `url`, a 503's body too (a decode node that is not ready says why in it)."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read() or b"{}")


def _decode(name: str, url: str, health: dict[str, Any]) -> NodeState:
    running = sum(int(health.get(key, 0)) for key in ("running", "prefilling", "parked"))
    detail = f"{health.get('prefill_nodes', 0)} prefill linked"
    if health.get("error"):
        detail += f"; {health['error']}"
    state = READY if health.get("ready") else NOT_READY
    return NodeState(name, "decode", url, state, running, int(health.get("waiting", 0)), detail)


def _prefill(name: str, url: str, status: dict[str, Any]) -> NodeState:
    held_mib = status.get("bytes_held", 0) / 2**20
    detail = f"{status.get('decode_nodes', 0)} decode linked, {status.get('requests_held', 0)} held {held_mib:.1f} MiB"
    return NodeState(name, "prefill", url, READY, int(status.get("requests_open", 0)), None, detail)


def _router(name: str, url: str, listed: dict[str, Any]) -> NodeState:
    workers = listed.get("workers", [])
    healthy = sum(bool(w.get("is_healthy")) for w in workers)
    state = READY if healthy else NOT_READY
    return NodeState(name, "router", url, state, None, None, f"{healthy}/{len(workers)} healthy")


_ASKED = {"decode": ("/health", _decode), "prefill": ("/status", _prefill), "router": ("/workers", _router)}


def node_state(name: str, role: str, url: str, process: subprocess.Popen | None) -> NodeState:
    """`role`'s row for the process `name` at base URL `url` (`process` None: not ours to watch, asked only)."""
    if process is not None and process.poll() is not None:
        return NodeState(name, role, url, LOST, detail=f"exited with code {process.returncode}")
    path, row = _ASKED[role]
    try:
        return row(name, url, _get(url + path))
    except (OSError, ValueError) as exc:  # refused, timed out, not JSON
        reason = getattr(exc, "reason", None) or exc
        state = LOST if process is None and isinstance(reason, ConnectionRefusedError) else NO_ANSWER
        return NodeState(name, role, url, state, detail=str(reason))
