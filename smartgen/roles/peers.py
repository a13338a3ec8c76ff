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
Each request goes to the live peer `placement.choose_prefill` picks (least queued prompt tokens, minus what
its prefix cache likely holds of this prompt: `PrefixAffinity`, forgotten when the peer is lost).
`snapshot()` is what /health shows per peer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from smartgen.engine.decode import DecodeEngine
from smartgen.engine.decode.control import LinkLoad
from smartgen.engine.prefix_cache import block_hashes
from smartgen.lanes.link import LinkEnd
from smartgen.lanes.wire import HandshakeError
from smartgen.roles.placement import PrefillLoad, PrefixAffinity, choose_prefill

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
    num_sent: int = 0  # requests opened on it (again after a lost peer included)
    num_affine: int = 0  # of those, sent for the prefix it likely had cached

    def set(self, state: str, error: str | None = None) -> None:
        self.state, self.error, self.since = state, error, time.time()


class PrefillPeers:
    """Keeps one link per prefill address attached to `engine`, reconnecting lost ones, and chooses one per request."""

    def __init__(
        self,
        engine: DecodeEngine,
        addresses: list[tuple[str, int]],
        connect: Connect,
        max_backoff_s: float = 1.0,
        affinity: PrefixAffinity | None = None,
    ) -> None:
        """`affinity`: which peer was sent which prompt blocks (None: choose by queued work alone)."""
        self.engine = engine
        self.connect = connect
        self.max_backoff_s = max_backoff_s
        self.affinity = affinity
        self.peers = [PeerState(address) for address in addresses]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        engine.on_link_lost = self._on_lost
        engine.choose_link = self._choose

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
        if self.affinity is not None:
            self.affinity.forget(peer.address)
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

    def _choose(self, loads: list[LinkLoad], prompt_ids: torch.Tensor | None) -> LinkEnd:
        """The engine's `choose_link`: the live link `choose_prefill` picks; the prompt's blocks are remembered."""
        affinity = self.affinity
        keys = (
            block_hashes(prompt_ids, affinity.block_tokens) if affinity is not None and prompt_ids is not None else []
        )
        with self._lock:
            by_link = {id(p.link): p for p in self.peers if p.link is not None}
        peers = [by_link.get(id(load.link)) for load in loads]  # None: a link made outside the peers (tests)
        choices = [
            PrefillLoad(
                load.queued_tokens,
                load.requests,
                affinity.cached_tokens(keys, peer.address) if affinity is not None and peer is not None else 0,
            )
            for load, peer in zip(loads, peers)
        ]
        index = choose_prefill(choices, 0 if prompt_ids is None else int(prompt_ids.numel()))
        chosen = peers[index]
        if chosen is not None:
            with self._lock:
                chosen.num_sent += 1
                chosen.num_affine += bool(choices[index].cached_tokens)
            if affinity is not None and keys:
                affinity.sent(keys, chosen.address)
        return loads[index].link

    def snapshot(self) -> list[dict[str, Any]]:
        """Per peer: address, state (up / down), since when, the last error, reconnects so far, and the requests
        sent to it (`sent`), of which for a prefix it likely had cached (`affine`)."""
        with self._lock:
            return [
                {
                    "address": "{}:{}".format(*p.address),
                    "state": p.state,
                    "since": p.since,
                    "error": p.error,
                    "reconnects": p.num_reconnects,
                    "sent": p.num_sent,
                    "affine": p.num_affine,
                }
                for p in self.peers
            ]

    def stop(self) -> None:
        """Stops reconnecting (call before the engine closes its links)."""
        self._stop.set()
