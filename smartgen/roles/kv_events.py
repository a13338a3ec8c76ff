"""Publishes a node's prefix-cache events in vLLM's KV-events format: ZMQ PUB of msgpack batches, and a replay socket.

What a subscriber of vLLM's (`vllm.distributed.kv_events`: Dynamo's KV router, llm-d's precise prefix-cache
scorer, SGLang's router) reads, frame for frame:

- PUB, multipart [topic, seq (8-byte big-endian), payload]; seq counts batches from 0 on this publisher;
- payload: a msgpack `KVEventBatch`, the array [ts (float, Unix seconds), events, data_parallel_rank (0)];
- each event tagged by its class name, as msgspec encodes a tagged Struct: in the `array` encoding (msgspec's
  `array_like`, vLLM up to 0.23) ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name], ["BlockRemoved", block_hashes, medium], ["AllBlocksCleared"]; in the `map` encoding (vLLM
  since its PR #42892) {"type": "BlockStored", "block_hashes": ..., ...} with the same names;
- replay: a ROUTER socket; a client (DEALER, or REQ framing) sends a start seq (8-byte big-endian) and gets every
  buffered batch from it on as [seq, payload], then [-1 (8-byte signed), b""].

A block hash is the first 8 bytes of our chained block key as an unsigned 64-bit integer (our keys already chain the
whole prefix, as vLLM's do); token_ids are the stored blocks' tokens, block_size tokens each. The first batch is
[AllBlocksCleared]: a node that starts holds nothing, whatever a subscriber knew of an earlier one on this endpoint.
The cache hands its events over while locked; they are queued, never sent on its thread (a full queue drops the
batch and counts it, it never blocks a request).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from smartgen.engine.cache_events import AllCleared, BlocksRemoved, BlocksStored, CacheEvent

__all__ = ["ENCODINGS", "KvEventsSettings", "KvEventPublisher", "block_hash", "encode_batch", "events_problem"]

log = logging.getLogger(__name__)

ENCODINGS = ("array", "map")
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True, slots=True)
class KvEventsSettings:
    """`serve --kv-events-endpoint` and its companions."""

    endpoint: str  # tcp://*:5557 binds (any address with '*', or ipc:// / inproc://); tcp://host:port connects
    replay_endpoint: str | None = None  # a ROUTER bound here (always bound, as vLLM's) answers replays; None: none
    topic: str = ""
    encoding: str = "array"
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000
    max_queue: int = 100_000


def events_problem(settings: KvEventsSettings) -> str | None:
    """Why these settings cannot publish (one line, naming the option), or None; checked before any model loads."""
    if settings.encoding not in ENCODINGS:
        return f"--kv-events-encoding must be one of {', '.join(ENCODINGS)}, got {settings.encoding!r}"
    for option, endpoint in (
        ("--kv-events-endpoint", settings.endpoint),
        ("--kv-events-replay", settings.replay_endpoint),
    ):
        if endpoint is not None and "://" not in endpoint:
            return f"{option} takes a ZMQ endpoint such as tcp://*:5557, got {endpoint!r}"
    try:
        import msgpack  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as exc:
        return f"KV events need pyzmq and msgpack ({exc.name} is missing): pip install 'smartgen[events]'"
    return None


def block_hash(key: bytes) -> int:
    """A cache key as vLLM's integer block hash (unsigned 64-bit)."""
    return int.from_bytes(key[:8], "big")


def _event(event: CacheEvent, encoding: str) -> Any:
    if isinstance(event, BlocksStored):
        parent = block_hash(event.parent) if event.parent is not None else None
        fields: dict[str, Any] = {
            "block_hashes": [block_hash(key) for key in event.keys],
            "parent_block_hash": parent,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": None,
        }
        tag = "BlockStored"
    elif isinstance(event, BlocksRemoved):
        fields, tag = {"block_hashes": [block_hash(key) for key in event.keys], "medium": event.medium}, "BlockRemoved"
    elif isinstance(event, AllCleared):
        fields, tag = {}, "AllBlocksCleared"
    else:
        raise TypeError(f"not a cache event: {event!r}")
    return [tag, *fields.values()] if encoding == "array" else {"type": tag, **fields}


def encode_batch(ts: float, events: list[CacheEvent], encoding: str = "array", dp_rank: int = 0) -> bytes:
    """One KVEventBatch as msgpack bytes."""
    import msgpack

    return msgpack.packb([ts, [_event(event, encoding) for event in events], dp_rank])


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind where the address is a wildcard or local transport, connect elsewhere."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    """A PUB socket (and a replay ROUTER) fed by `listener`; `close()` stops it. Sockets are bound or connected
    here (an address in use fails now, with zmq's reason) and used only by the publisher's thread."""

    def __init__(self, settings: KvEventsSettings) -> None:
        import zmq

        self.settings = settings
        self.batches = self.dropped = 0
        self._queue: queue.Queue[tuple[float, list[CacheEvent]] | None] = queue.Queue(maxsize=settings.max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=settings.buffer_steps)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(settings.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if _binds(settings.endpoint):
                self._pub.bind(settings.endpoint)
            else:
                self._pub.connect(settings.endpoint)
            if settings.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(settings.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(f"KV events: cannot open {settings.endpoint}: {exc}") from None
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or settings.endpoint
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else None
        self._queue.put((time.time(), [AllCleared()]))
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def listener(self, events: list[CacheEvent]) -> None:
        """The prefix cache's listener: queues one batch, never waits."""
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped += 1

    def close(self) -> None:
        """Sends what is queued (up to a second), then closes the sockets."""
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            pass
        self._thread.join(timeout=2.0)
        self._close_sockets()

    def snapshot(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "batches": self.batches,
            "dropped_batches": self.dropped,
        }

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._context.term()

    def _run(self) -> None:
        topic = self.settings.topic.encode()
        while True:
            if self._replay is not None:
                self._serve_replays()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            try:
                payload = encode_batch(ts, events, self.settings.encoding)
                seq = self.batches
                self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.batches += 1
            except Exception:  # a publisher must not take the node down: log it and go on
                log.exception("KV events: publishing a batch failed")

    def _serve_replays(self) -> None:
        import zmq

        assert self._replay is not None
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3:  # [identity, empty delimiter, start seq] from a REQ socket
                log.warning("KV events: a replay request of %d frames ignored", len(frames))
                continue
            identity, _, start = frames
            first = int.from_bytes(start, "big")
            try:
                for seq, payload in list(self._buffer):
                    if seq >= first:
                        self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
                self._replay.send_multipart((identity, b"", END_SEQ, b""))
            except zmq.ZMQError as exc:  # the client left: nothing to answer
                log.warning("KV events: replay answer not sent: %s", exc)
