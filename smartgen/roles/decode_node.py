"""The decode node: connects to its prefill nodes, owns the KV pool, runs the scheduler behind the HTTP API.

See smartgen.roles.scheduler for a request's life here, roles.placement for which prefill node serves a request,
and lanes.ingress for `ingress_gbps` (one paced link that every prefill node's bytes into this node cross).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import torch
from transformers import PreTrainedModel

from smartgen.engine.decode import DecodeEngine
from smartgen.engine.layout import KVLayout
from smartgen.engine.policy import Policy
from smartgen.engine.prefix_cache import PrefixCache
from smartgen.lanes.backends import lands_in_device_memory, lane_factory
from smartgen.lanes.link import LinkEnd
from smartgen.lanes.liveness import Lease
from smartgen.lanes.pacer import Pacer
from smartgen.lanes.rdma.select import RdmaOptions
from smartgen.lanes.tcp_link import tcp_connect
from smartgen.lanes.tls import TlsFiles
from smartgen.roles.identity import node_identity
from smartgen.roles.limits import DecodeLimits
from smartgen.roles.monitoring import decode_monitoring
from smartgen.roles.peers import Connect, PrefillPeers
from smartgen.roles.placement import PrefixAffinity
from smartgen.roles.scheduler import DecodeScheduler
from smartgen.runtime.decode import DecodeRunner
from smartgen.runtime.emulation import Emulation
from smartgen.selectors.base import Selector

__all__ = ["DecodeNode", "staged_pool"]

log = logging.getLogger(__name__)


class DecodeNode:
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any,
        selector: Selector,
        layout: KVLayout,
        policy: Policy,
        prefill_addresses: list[tuple[str, int]],
        *,
        secret: str = "",
        model_name: str = "model",
        max_batch: int = 8,
        max_tokens: int = 8192,
        link_gbps: float | None = None,
        delay_s: float = 0.0,
        max_waiting: int = 64,
        lane: str = "tcp",
        rdma: RdmaOptions | None = None,
        emulation: Emulation | None = None,
        limits: DecodeLimits | None = None,
        prefix_cache: PrefixCache | None = None,
        tls: TlsFiles | None = None,
        connect: Connect | None = None,
        ingress_gbps: float | None = None,
    ) -> None:
        """`connect(host, port)` makes the link to a prefill node; None: the TCP lane `lane` with the handshake.
        `serve --role both` passes one that joins a prefill node in this process over an in-process link.
        `ingress_gbps`: what every prefill node sends here crosses one link of this rate (lanes/ingress.py; the tcp
        lane's own connections only); `link_gbps` paces what this node sends, per prefill node."""
        if not prefill_addresses:
            raise ValueError("a decode node needs at least one prefill node (--prefill HOST:PORT)")
        if ingress_gbps is not None and (connect is not None or lane != "tcp"):
            raise ValueError(f"--ingress-gbps paces what the tcp lane's sockets read; --lane {lane} moves KV past them")
        self.ingress = Pacer(ingress_gbps) if ingress_gbps else None
        self.link_gbps, self.delay_s = link_gbps, delay_s
        limits = limits or DecodeLimits()
        self.engine = DecodeEngine(
            layout,
            num_slots=max_batch,
            max_tokens=max_tokens,
            device=str(model.device),
            fetch_timeout=limits.fetch_timeout_s,
            stall_timeout=limits.fetch_stall_s,
            step_share=limits.step_share,
            recompute=limits.on_prefill_failure == "recompute",
            prefix_cache=prefix_cache,
            prefill_timeout=limits.first_token_timeout_s,
            staged=staged_pool(lane, model.device),
        )
        hello = {
            **node_identity(model, layout, model_name),
            "lane": lane,
            "pool": {"slots": max_batch, "max_tokens": max_tokens},
            "node": uuid.uuid4().hex[:8],
        }
        if connect is None:
            connect = _tcp_connect(hello, secret, link_gbps, delay_s, lane, limits, tls, rdma, self.ingress)
        # the prefill nodes cache prompt blocks as this node does (`--prefix-cache-bytes` and `--prefix-block-tokens`,
        # the same on both): steer a prompt to the one that prefilled its prefix lately
        affinity = (
            PrefixAffinity(prefix_cache.block_tokens) if prefix_cache is not None and prefix_cache.enabled else None
        )
        self.peers = PrefillPeers(self.engine, prefill_addresses, connect, affinity=affinity)
        try:
            self.peers.connect_all()
        except BaseException:
            self.peers.stop()
            self.engine.close()
            raise
        self.runner = DecodeRunner(model, selector, self.engine, emulation=emulation)
        self.scheduler = DecodeScheduler(
            self.runner,
            tokenizer,
            policy,
            model_name,
            max_waiting=max_waiting,
            prefill_timeout=limits.first_token_timeout_s,
            queue_timeout=limits.queue_timeout_s,
            peers=self.peers.snapshot,
        )
        peers = [f"{host}:{port}" for host, port in prefill_addresses]
        self.monitoring = decode_monitoring(self.engine, self.scheduler, self.links, peers, model_name)
        self.scheduler.status_hooks.append(self._link_status)

    def link_status(self) -> dict[str, Any]:
        """Which pacing applies to the links into this node (/status "link"; the bench's regime line reads it).

        `pacing`: "shared ingress" (one link of `ingress_gbps` that all prefill nodes' bytes cross), or "per prefill
        node" (each prefill node paces what it sends with its own `--link-gbps`, shown in its own /status; `serve
        --role both`: its in-process link's). `egress_gbps`: this node's own sends, per link."""
        return {
            "pacing": "per prefill node" if self.ingress is None else "shared ingress",
            "ingress_gbps": None if self.ingress is None else self.ingress.gbps,
            "egress_gbps": self.link_gbps,
            "delay_ms": self.delay_s * 1e3,
            "prefill_nodes": len(self.peers.peers),
        }

    def _link_status(self, snapshot: dict[str, Any]) -> None:
        snapshot["link"] = self.link_status()

    @property
    def links(self) -> list[LinkEnd]:
        return self.engine.links

    def start(self) -> None:
        self.scheduler.start()

    def stop(self, reason: str = "decode node is shutting down") -> None:
        """Fails in-flight requests with `reason`, releases them on the prefill nodes, closes the links."""
        self.peers.stop()
        self.scheduler.stop(reason)
        self.monitoring.close()
        self.runner.close()
        self.engine.close()


def staged_pool(lane: str, device: torch.device) -> bool:
    """Whether the decode pool on `device` must stage through host memory: `lane` cannot land writes in that device's
    memory (a one-sided lane without a way to register it). Says so once in the log when it must."""
    staged = not lands_in_device_memory(lane, device)
    if staged:
        log.warning(
            "decode: the %s lane cannot register %s memory here; the KV pool stages through host memory (one "
            "host->device copy per landed entry, before each layer reads its masks; docs/lanes.md, GPU memory)",
            lane,
            device,
        )
    return staged


def _tcp_connect(
    hello: dict[str, Any],
    secret: str,
    link_gbps: float | None,
    delay_s: float,
    lane: str,
    limits: DecodeLimits,
    tls: TlsFiles | None,
    rdma: RdmaOptions | None = None,
    ingress: Pacer | None = None,
) -> Connect:
    """Connects over `lane` (TCP sockets underneath) with the authenticated handshake; `ingress`: the shared link
    every connection's reads cross (None: reads are not paced here)."""
    factory = lane_factory(lane, limits.one_sided, rdma)
    tls_context = None if tls is None else tls.client_context()
    lease = Lease(limits.lease_s)

    def connect(host: str, port: int) -> LinkEnd:
        return tcp_connect(
            host,
            port,
            secret,
            hello,
            gbps=link_gbps,
            delay_s=delay_s,
            timeout=limits.handshake_timeout_s,
            lane_factory=factory,
            lease=lease,
            tls=tls_context,
            ingress=ingress,
        )

    return connect
