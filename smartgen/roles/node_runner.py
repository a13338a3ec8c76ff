"""Runs one node process from its settings: what `smartgen serve` does once its options are read.

`run_node(settings)` is the whole of it: check the settings, build and start the node of `settings.role`, serve
(the decode half's HTTP API, the prefill half's status endpoint, the `--record` frames), write the ready file, wait
for SIGINT or SIGTERM (or a `stop` event), then stop everything in order. `start_node` is the same without the
wait, for a caller that embeds a node and stops it itself.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from smartgen.engine.prefix_cache import PrefixCache
from smartgen.lanes.backends import INPROC
from smartgen.lanes.tcp_link import parse_address
from smartgen.roles.colocated import build_colocated_node
from smartgen.roles.decode_node import DecodeNode
from smartgen.roles.http_server import HttpServer
from smartgen.roles.kv_events import KvEventPublisher
from smartgen.roles.launch import build_decode_node, build_prefill_node
from smartgen.roles.limits import DecodeLimits
from smartgen.roles.prefill_node import PrefillNode
from smartgen.roles.processes import write_ready_file
from smartgen.roles.recorder import StatusRecorder
from smartgen.roles.serve_settings import ServeSettings
from smartgen.roles.status import StatusServer

__all__ = ["RunningNode", "run_node", "start_node"]

SHUTDOWN_REASON = "decode node is shutting down"  # what in-flight requests fail with when the node stops


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class RunningNode:
    """A started node: `addresses` (what the ready file says) and `stop()`. Made by `start_node`."""

    def __init__(self, settings: ServeSettings, say: Callable[[str], None]) -> None:
        self.settings, self._say = settings, say
        self.addresses: dict[str, Any] = {"role": settings.role}
        self.prefill: PrefillNode | None = None
        self.decode: DecodeNode | None = None
        self.http: HttpServer | None = None
        self._cleanup = ExitStack()  # what is started, stopped in reverse order

    @property
    def serving(self) -> bool:
        """False once the HTTP API has ended by itself (a stopped node, or uvicorn failing)."""
        return self.http is None or self.http.running

    def stop(self) -> None:
        """Fails in-flight requests (their streams end with the reason), stops the HTTP API, then the nodes."""
        if self.settings.role == "prefill" and self.prefill is not None:
            self._say("prefill node stopping")
        if self.decode is not None:
            self.decode.scheduler.stop(SHUTDOWN_REASON)
        self._cleanup.close()

    def write_ready_file(self) -> None:
        if self.settings.ready_file is not None:
            write_ready_file(self.settings.ready_file, self.addresses)

    def _start_prefill(self, node: PrefillNode, profile_note: str) -> None:
        s = self.settings
        self.prefill = node
        node.start()
        if s.role == "both":
            self._cleanup.callback(self._say, "prefill node stopped")
        self._cleanup.callback(node.stop)
        if node.address is not None:  # a colocated prefill half listens on no socket
            self.addresses["listen"] = "{}:{}".format(*node.address)
        if s.status:
            server = StatusServer(*parse_address(s.status), node.snapshot, node.monitoring.exposition)
            self._cleanup.callback(server.close)
            self.addresses["status"] = "{}:{}".format(*server.address)
        if s.record is not None and s.role == "prefill":
            self._cleanup.callback(StatusRecorder(s.record, "prefill", node.snapshot).close)
        if s.role == "prefill":  # --role both publishes its decode half's cache, the one a router in front sees
            self._publish_events(node.engine.prefix_cache, node.status_hooks)
        gbps = s.node.link_gbps
        if s.role == "prefill":
            rate = f"{gbps:g} Gbit/s" if gbps else "unpaced"
            self._say(
                f"prefill node listening on {self.addresses['listen']} (model {node.identity['model']}, link {rate}, "
                f"profiles: {profile_note})"
            )
        else:
            rate = f"{gbps:g} Gbit/s each way" if gbps else "unpaced"
            where = f" (status on {self.addresses['status']})" if "status" in self.addresses else ""
            self._say(f"prefill node in this process{where}: in-process lane, link {rate}, profiles: {profile_note}")

    def _publish_events(self, cache: PrefixCache, status_hooks: list[Callable[[dict[str, Any]], None]]) -> None:
        """`--kv-events-endpoint`: the cache's block events go out in vLLM's format until the node stops; the
        node's /status says where and how many (`kv_events`)."""
        events = self.settings.node.kv_events
        if events is None:
            return
        publisher = KvEventPublisher(events)
        status_hooks.append(lambda snapshot: snapshot.__setitem__("kv_events", publisher.snapshot()))
        self._cleanup.callback(publisher.close)
        cache.set_listener(publisher.listener)
        self._cleanup.callback(cache.set_listener, None)  # runs first: nothing is queued on a closing publisher
        self.addresses["kv_events"] = publisher.endpoint
        replay = ""
        if publisher.replay_endpoint is not None:
            self.addresses["kv_events_replay"] = publisher.replay_endpoint
            replay = f", replay on {publisher.replay_endpoint}"
        self._say(f"KV events ({events.encoding} encoding) on {publisher.endpoint}{replay}")

    def _start_decode(self, node: DecodeNode, limits: DecodeLimits) -> None:
        s = self.settings
        self.decode = node
        self._cleanup.callback(self._say, "decode node stopped")
        self._cleanup.callback(node.stop)
        http = HttpServer(node, *parse_address(s.http), limits.max_body_bytes, s.role)  # bound first: port 0 works
        node.start()
        if s.record is not None:
            prefill = self.prefill.snapshot if self.prefill is not None else None
            recorder = StatusRecorder(s.record, "decode", node.scheduler.status, prefill_snapshot=prefill)
            self._cleanup.callback(recorder.close)
        self._cleanup.callback(http.stop)
        self._publish_events(node.engine.prefix_cache, node.scheduler.status_hooks)
        http.start()
        self.http = http
        self.addresses["http"] = "{}:{}".format(*http.address)
        peers = "in this process" if s.role == "both" else s.prefill
        ingress = f", shared ingress link {s.ingress_gbps:g} Gbit/s" if s.ingress_gbps else ""
        self._say(
            f"decode node: OpenAI API on http://{self.addresses['http']}/v1 (prefill nodes {peers}{ingress}, scheme "
            f"{s.decode.scheme})"
        )


def run_node(
    settings: ServeSettings, stop: threading.Event | None = None, say: Callable[[str], None] = _stderr
) -> None:
    """Serves until SIGINT or SIGTERM (on the main thread) or until `stop` is set, then stops the node and returns.

    Raises ValueError for settings that cannot run (`ServeSettings.check`), and what building the node raises
    (ModelLoadError, HandshakeError, OSError...). `say` gets the lines a user reads (addresses, stopping).
    """
    stop = stop or threading.Event()
    started: list[RunningNode] = []

    def on_signal(*_: Any) -> None:
        stop.set()
        if not started:  # still loading the model: interrupt that, as the default handler would
            raise KeyboardInterrupt

    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        # kept until the node is down: a second signal must not kill the process halfway through stopping it
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        started.append(_start(settings, say))
        started[0].write_ready_file()  # only now: a signal from whoever reads it stops the node cleanly
        while not stop.wait(0.5) and started[0].serving:
            pass
    finally:
        if started:
            started[0].stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def start_node(settings: ServeSettings, say: Callable[[str], None] = _stderr) -> RunningNode:
    """Checks `settings`, builds and starts the node of `settings.role` with its endpoints, writes the ready file,
    and returns it serving; `RunningNode.stop()` stops it. Whatever fails half-way is stopped before it raises."""
    running = _start(settings, say)
    try:
        running.write_ready_file()
    except BaseException:
        running.stop()
        raise
    return running


def _start(settings: ServeSettings, say: Callable[[str], None]) -> RunningNode:
    settings.check()
    s, running = settings, RunningNode(settings, say)
    model_name = s.node.model.name
    decode_limits = s.decode.limits or DecodeLimits()
    try:
        if s.role == "prefill":
            host, port = parse_address(s.listen)
            prefill, note = build_prefill_node(
                s.node, host, port, s.node.db, s.fallback_strategy, model_name, s.prefill_limits
            )
            # the decode steps a prefill node runs (forecast, head start) pay the decode device's emulated compute
            prefill.runner.emulation = s.decode.emulation()
            running._start_prefill(prefill, note)
        elif s.role == "both":
            both, note = build_colocated_node(s.node, s.fallback_strategy, model_name, s.prefill_limits, s.decode)
            both.prefill.runner.emulation = s.decode.emulation()
            try:
                running._start_prefill(both.prefill, note)
            except BaseException:
                both.decode.stop()  # built, not started: RunningNode does not hold it yet
                raise
            running.addresses["lane"] = INPROC
            running._start_decode(both.decode, decode_limits)
        else:
            addresses = [parse_address(a) for a in s.prefill.split(",") if a.strip()]
            d = s.decode
            decode = build_decode_node(
                s.node,
                addresses,
                d.scheme,
                d.speculative_ratio,
                model_name,
                d.max_batch,
                d.max_tokens,
                d.max_waiting,
                emulation=d.emulation(),
                limits=decode_limits,
                ingress_gbps=s.ingress_gbps,
            )
            running._start_decode(decode, decode_limits)
    except BaseException:
        running.stop()
        raise
    return running
