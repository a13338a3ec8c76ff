"""The decode node: connects to its prefill nodes, owns the KV pool, runs the scheduler behind the HTTP API.

See smartgen.roles.scheduler for a request's life here.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from transformers import PreTrainedModel

from smartgen.engine.decode import DecodeEngine
from smartgen.engine.layout import KVLayout
from smartgen.engine.policy import Policy
from smartgen.lanes.backends import lane_factory
from smartgen.lanes.tcp_link import tcp_connect
from smartgen.roles.identity import node_identity
from smartgen.roles.monitoring import decode_monitoring
from smartgen.roles.scheduler import DecodeScheduler
from smartgen.runtime.decode import DecodeRunner
from smartgen.selectors.base import Selector

__all__ = ["DecodeNode"]

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
        emulate_layer_s: float = 0.0,
    ) -> None:
        if not prefill_addresses:
            raise ValueError("a decode node needs at least one prefill node (--prefill HOST:PORT)")
        self.engine = DecodeEngine(layout, num_slots=max_batch, max_tokens=max_tokens, device=str(model.device))
        hello = {
            **node_identity(model, layout, model_name),
            "lane": lane,
            "pool": {"slots": max_batch, "max_tokens": max_tokens},
            "node": uuid.uuid4().hex[:8],
        }
        factory = lane_factory(lane)
        self.links = []
        try:
            for host, port in prefill_addresses:
                try:
                    link = tcp_connect(host, port, secret, hello, gbps=link_gbps, delay_s=delay_s, lane_factory=factory)
                except OSError as exc:
                    raise ConnectionError(
                        f"cannot reach the prefill node at {host}:{port}: {exc.strerror or exc}"
                    ) from exc
                self.links.append(link)
                self.engine.attach(link)
        except BaseException:
            self.engine.close()
            raise
        self.runner = DecodeRunner(model, selector, self.engine, emulate_layer_s=emulate_layer_s)
        self.scheduler = DecodeScheduler(self.runner, tokenizer, policy, model_name, max_waiting=max_waiting)
        peers = [f"{host}:{port}" for host, port in prefill_addresses]
        self.monitoring = decode_monitoring(self.engine, self.scheduler, self.links, peers, model_name)

    def start(self) -> None:
        self.scheduler.start()

    def stop(self, reason: str = "decode node is shutting down") -> None:
        """Fails in-flight requests with `reason`, releases them on the prefill nodes, closes the links."""
        self.scheduler.stop(reason)
        self.monitoring.close()
        self.runner.close()
        self.engine.close()
