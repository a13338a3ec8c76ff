"""The decode node's prefill peers: connects to each, notices a lost link, reconnects with backoff.

A peer's life here:
1. `connect_all()` at start-up: every address must answer (a wrong secret or model stops the
   node with the handshake's reason, as before).
2. up: its link is attached to the engine and requests may pick it.
3. down: the engine dropped the link (peer died, went silent past its lease, or misbehaved)
   and calls `_on_lost`; a reconnect thread retries with exponential backoff (0.1 s doubling
   to `max_backoff_s`), so a restarted prefill node is back in service within about a second
   of listening again.
4. up again: the new link is attached; requests pick it from then on.
`snapshot()` is what /health shows per peer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from smartgen.engine.decode import DecodeEngine
from smartgen.lanes.link import LinkEnd
from smartgen.lanes.wire import HandshakeError

__all__ = ["PrefillPeers", "PeerState"]

log = logging.getLogger(__name__)

Connect = Callable[[str, int], LinkEnd]


@dataclass(slots=True)
class PeerState:
    address: tuple[str, int]
    state: str = "connecting"  # "up" | "down" | "connecting"
    since: float = 0.0  # time.time() of the last change
    error: str | None = None
    num_reconnects: int = 0
    link: LinkEnd | None = None

    def set(self, state: str, error: str | None = None) -> None:
        self.state, self.error, self.since = state, error, time.time()


class PrefillPeers:
    """Keeps one link per prefill address attached to `engine`, reconnecting lost ones."""

    def __init__(
        self, engine: DecodeEngine, addresses: list[tuple[str, int]], connect: Connect, max_backoff_s: float = 1.0
    ) -> None:
        self.engine = engine
        self.connect = connect
        self.max_backoff_s = max_backoff_s
        self.peers = [PeerState(address) for address in addresses]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        engine.on_link_lost = self._on_lost

    def connect_all(self) -> None:
        """Connects to every prefill node once; raises ConnectionError / HandshakeError with the reason."""
        for peer in self.peers:
            host, port = peer.address
            try:
                link = self.connect(host, port)
            except OSError as exc:
                raise ConnectionError(f"cannot reach the prefill node at {host}:{port}: {exc.strerror or exc}") from exc
            self._attach(peer, link)

    def _attach(self, peer: PeerState, link: LinkEnd) -> None:
        with self._lock:
            peer.link = link
            peer.set("up")
        self.engine.attach(link)

    def _on_lost(self, link: LinkEnd, reason: str) -> None:
        with self._lock:
            peer = next((p for p in self.peers if p.link is link), None)
            if peer is None or self._stop.is_set():
                return
            peer.link = None
            peer.set("down", reason)
        log.warning("prefill node %s:%d lost (%s); reconnecting", *peer.address, reason)
        threading.Thread(target=self._reconnect, args=(peer,), name="prefill-reconnect", daemon=True).start()

    def _reconnect(self, peer: PeerState) -> None:
        delay = 0.1
        host, port = peer.address
        while not self._stop.wait(delay):
            try:
                link = self.connect(host, port)
            except (OSError, ConnectionError, HandshakeError) as exc:
                with self._lock:
                    peer.error = f"reconnecting: {exc}"
                delay = min(delay * 2, self.max_backoff_s)
                continue
            if self._stop.is_set():
                link.close()
                return
            peer.num_reconnects += 1
            self._attach(peer, link)
            log.info("prefill node %s:%d reconnected", host, port)
            return

    def snapshot(self) -> list[dict[str, Any]]:
        """Per peer: address, state (up / down), since when, the last error, reconnects so far."""
        with self._lock:
            return [
                {
                    "address": "{}:{}".format(*p.address),
                    "state": p.state,
                    "since": p.since,
                    "error": p.error,
                    "reconnects": p.num_reconnects,
                }
                for p in self.peers
            ]

    def stop(self) -> None:
        """Stops reconnecting (call before the engine closes its links)."""
        self._stop.set()
