"""The prefill node: a long-running process that prefills requests for decode nodes and moves their KV.

A request's life on a prefill node:
1. A decode node connects (two TCP connections: push, control) and is authenticated:
   protocol version, shared secret, model fingerprint, KV layout. (A colocated decode node,
   `serve --role both`, is attached directly over an in-process link instead.)
2. OPEN arrives with the prompt ids and the decode node's pool slot; it is queued (bounded:
   a full queue answers ERROR) and its transfer plan is made from the matching profile, or
   the fallback strategy when none exists.
3. Prefill runs layer by layer; after each layer its KV goes to the request's store and the
   layer's planned blocks are pushed (data, then mask).
4. FIRST_TOKEN goes out with the selector metadata.
5. FETCH requests are answered and each idle notice pushes the next speculative slice
   (the engine's serve thread, per decode node).
6. RELEASE, ABORT, or the decode node's connection lost (closed, or silent past its lease:
   heartbeats flow both ways on every connection): the store is freed; other decode nodes
   are served on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedModel

from smartgen.engine.layout import KVLayout
from smartgen.engine.pool import PoolGeometry
from smartgen.engine.prefill import PrefillEngine
from smartgen.engine.prefix_cache import PrefixCache
from smartgen.lanes.backends import lane_factory
from smartgen.lanes.link import LinkEnd
from smartgen.lanes.link_timeline import merged
from smartgen.lanes.liveness import Lease
from smartgen.lanes.pacer import Pacer
from smartgen.lanes.rdma.select import RdmaOptions
from smartgen.lanes.tcp_link import TcpListener
from smartgen.lanes.thread_priority import lower_this_thread
from smartgen.lanes.tls import TlsFiles
from smartgen.roles.cpu_timeline import process_cpu_timeline
from smartgen.roles.identity import node_identity
from smartgen.roles.limits import PrefillLimits
from smartgen.roles.monitoring import prefill_monitoring
from smartgen.roles.planner import NodePlanner
from smartgen.roles.thread_cpu import thread_cpu_seconds, thread_policies
from smartgen.runtime.prefill import PrefillRunner
from smartgen.runtime.prefill_worker import PrefillWorker
from smartgen.selectors.base import Selector

__all__ = ["PrefillNode"]

log = logging.getLogger(__name__)


class PrefillNode:
    def __init__(
        self,
        model: PreTrainedModel,
        selector: Selector,
        layout: KVLayout,
        planner: NodePlanner,
        *,
        host: str = "127.0.0.1",
        port: int = 7100,
        secret: str = "",
        model_name: str = "model",
        link_gbps: float | None = None,
        delay_s: float = 0.0,
        lane: str = "tcp",
        rdma: RdmaOptions | None = None,
        prefix_cache: PrefixCache | None = None,
        limits: PrefillLimits | None = None,
        tls: TlsFiles | None = None,
        listen: bool = True,
    ) -> None:
        """`listen=False`: no TCP listener; decode nodes in this process come in through `attach` (`serve --role
        both`)."""
        limits = limits or PrefillLimits()
        self.model = model
        self.layout = layout
        self.planner = planner
        self.engine = PrefillEngine(
            layout,
            planner,
            max_queue=limits.max_queue,
            flush_timeout_s=limits.flush_timeout_s,
            max_store_bytes=limits.max_store_bytes,
            prefix_cache=prefix_cache,
        )
        self.runner = PrefillRunner(model, selector)
        self.worker = PrefillWorker(
            self.engine, self.runner, on_prefilled=planner.record_prefill, on_metadata=planner.record_metadata
        )
        self.identity = {**node_identity(model, layout, model_name), "lane": lane}
        self.link_gbps, self.delay_s = link_gbps, delay_s
        self.listener = (
            TcpListener(
                host,
                port,
                secret,
                self.identity,
                Pacer(link_gbps, delay_s),
                lane_factory=lane_factory(lane, limits.one_sided, rdma),
                lease=Lease(limits.lease_s),
                handshake_timeout_s=limits.handshake_timeout_s,
                tls=None if tls is None else tls.server_context(),
            )
            if listen
            else None
        )
        self.address = self.listener.address if self.listener is not None else None
        self.monitoring = prefill_monitoring(
            self.engine, model_name, lambda: self.num_prefilled, lambda: self.head_start
        )
        self.status_hooks: list[Callable[[dict[str, Any]], None]] = []  # each adds to /status (KV events...)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work_loop, name="prefill-work", daemon=True)]
        if self.listener is not None:
            self._threads.append(threading.Thread(target=self._accept_loop, name="prefill-accept", daemon=True))

    def start(self) -> None:
        process_cpu_timeline()  # its threads' CPU, second by second, from now (`cpu_timeline`)
        for thread in self._threads:
            thread.start()

    def snapshot(self) -> dict[str, Any]:
        """Live state for the monitor: requests held, bytes per path, link counters, throughput."""
        snapshot = {
            "role": "prefill",
            "model": self.identity["model"],
            "requests_held": self.engine.store.num_requests,
            "bytes_held": self.engine.store.bytes_held,
            "store_cap_bytes": self.engine.store.max_bytes,
            "requests_open": self.engine.num_open,
            "prefilled": self.num_prefilled,
            # tokens decoded here while idle, ahead of the decode node (Policy.head_start), and this node's decode
            # steps given up for a prompt waiting for prefill (head-start steps, forecasts of a first step)
            "head_start": dict(zip(("tokens", "steps_yielded"), self.head_start)),
            "paths": self.engine.counters.snapshot(),
            # CPU seconds of this node's threads by role: what shares its CPUs with prefill (`thread_cpu`)
            "threads_cpu": thread_cpu_seconds(),
            "threads_policy": thread_policies(),  # none batched here: its threads that answer fetches must preempt
            "cpu_timeline": process_cpu_timeline().snapshot(),  # the same, second by second, in ms (`cpu_timeline`)
            # KV bytes fetches sent that a push had sent already (on the link when the step asked): what crossed twice
            "crossed_twice_bytes": sum(self.engine.crossed_twice.snapshot()["bytes"].values()),
            "decode_nodes": len(self.engine.links),
            # one pacer for every decode node this node sends to, as one NIC (a decode node's --ingress-gbps paces
            # what arrives there, in that node's /status)
            "link": {
                "pacing": "unpaced" if self.link_gbps is None else "per prefill node",
                "egress_gbps": self.link_gbps,
                "delay_ms": self.delay_s * 1e3,
                # what the link carried second by second, by tag (a paced link's; `lanes/link_timeline.py`)
                "timeline": self._link_timeline(),
            },
            "links": [
                {"push": link.push.counters.snapshot(), "control": link.control.counters.snapshot()}
                for link in self.engine.links
            ],
        }
        self.monitoring.decorate(snapshot)
        for hook in self.status_hooks:
            hook(snapshot)
        return snapshot

    def _link_timeline(self) -> dict[str, Any]:
        """What this node's link carried, second by second: its listener's pacer (one for every decode node it sends
        to), or without a listener (`serve --role both`) its in-process links' pacers together."""
        if self.listener is not None:
            return self.listener.pacer.timeline.snapshot()
        pacers = {id(link.pacer): link.pacer for link in self.engine.links}
        return merged([pacer.timeline.snapshot() for pacer in pacers.values()])

    def stop(self) -> None:
        """Stops accepting and prefilling; connected decode nodes see their links close."""
        self._stop.set()
        self.monitoring.close()
        if self.listener is not None:
            self.listener.close()
        self.engine.close()
        for thread in self._threads:
            if thread.ident is not None:  # a node stopped before it started (a colocated decode half failed)
                thread.join(timeout=5)

    def attach(self, link: LinkEnd, geometry: PoolGeometry, node: str = "?") -> None:
        """Serves one decode node (named `node` in the log) over `link`; `geometry` is its KV pool's."""
        log.info("decode node %s connected (%d slots of %d tokens)", node, geometry.num_slots, geometry.max_tokens)
        self.engine.attach(link, geometry)

    def _accept_loop(self) -> None:
        assert self.listener is not None
        while not self._stop.is_set():
            accepted = self.listener.accept(timeout=0.2)
            if accepted is None:
                continue
            link, hello = accepted
            pool = hello.get("pool") or {}
            try:
                geometry = PoolGeometry(self.layout, int(pool["slots"]), int(pool["max_tokens"]))
            except (KeyError, TypeError, ValueError):
                log.warning("decode node sent no pool geometry; closing its link")
                link.close()
                continue
            self.attach(link, geometry, hello.get("node", "?"))

    @property
    def num_prefilled(self) -> int:
        return self.worker.num_prefilled

    @property
    def head_start(self) -> tuple[int, int]:
        return self.worker.head_tokens, self.worker.steps_yielded

    def _work_loop(self) -> None:
        # prompts, the head start and the forecast are throughput work: the threads that answer fetches go first
        lower_this_thread()
        self.worker.run(self._stop, poll=0.2)
