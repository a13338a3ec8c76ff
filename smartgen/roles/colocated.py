"""A prefill node and a decode node in one process (`serve --role both`), joined by the in-process paced lane.

The same two nodes as `serve --role prefill` and `--role decode`, minus the sockets between
them: one model is loaded and shared (the runners route attention per thread), and the decode
node's link to its prefill node is an `inproc_link` whose pacers charge every byte, writes and
messages, in both directions, as the TCP lane's do.
"""

from __future__ import annotations

from dataclasses import dataclass

from smartgen.engine.pool import PoolGeometry
from smartgen.lanes.link import LinkEnd, inproc_link
from smartgen.roles.decode_node import DecodeNode
from smartgen.roles.launch import DTYPES, NodeSettings, build_decode_node, build_prefill_node
from smartgen.roles.limits import DecodeLimits, PrefillLimits
from smartgen.roles.peers import Connect
from smartgen.roles.prefill_node import PrefillNode
from smartgen.runtime.emulation import Emulation
from smartgen.runtime.models import load_model

__all__ = ["ColocatedNode", "DecodeSettings", "INPROC_PEER", "build_colocated_node", "inproc_connect"]

INPROC_PEER = ("in-process", 0)  # the prefill peer's "address" in the decode node's /health and /status


@dataclass(frozen=True, slots=True)
class DecodeSettings:
    """The decode node's own settings (`serve`'s decode panel)."""

    scheme: str = "smartgen"
    speculative_ratio: float = 0.1
    max_batch: int = 8
    max_tokens: int = 8192
    max_waiting: int = 64
    emulate_layer_ms: float = 0.0
    emulate_floor_ms: float = 0.0  # or: each decode layer topped up to this (runtime/emulation.py)
    limits: DecodeLimits | None = None

    def emulation(self) -> Emulation:
        """The emulated decode device these settings ask for (`--emulate-layer-ms` or `--emulate-layer-floor-ms`)."""
        return Emulation(self.emulate_layer_ms / 1e3, self.emulate_floor_ms / 1e3)


@dataclass(slots=True)
class ColocatedNode:
    prefill: PrefillNode
    decode: DecodeNode

    def start(self) -> None:
        self.prefill.start()
        self.decode.start()

    def stop(self) -> None:
        """The decode node first (it fails in-flight requests and releases them), then the prefill node."""
        self.decode.stop()
        self.prefill.stop()


def inproc_connect(prefill: PrefillNode, geometry: PoolGeometry, gbps: float | None, delay_s: float) -> Connect:
    """A `connect` for DecodeNode: each call makes a new in-process link and attaches its prefill end to `prefill`
    (serving a pool of `geometry`, as a TCP handshake would say); the address is ignored."""

    def connect(host: str, port: int) -> LinkEnd:
        prefill_end, decode_end = inproc_link(gbps, delay_s, name="colocated")
        prefill.attach(prefill_end, geometry, "in-process")
        return decode_end

    return connect


def build_colocated_node(
    settings: NodeSettings,
    fallback_strategy: str,
    model_name: str,
    prefill_limits: PrefillLimits,
    decode: DecodeSettings,
) -> tuple[ColocatedNode, str]:
    """A prefill node and a decode node sharing one loaded model, joined by the in-process lane paced at
    `settings.link_gbps` each way (`serve --role both`)."""
    model = load_model(settings.model, DTYPES[settings.dtype], settings.device)
    prefill, profile_note = build_prefill_node(
        settings, "", 0, settings.db, fallback_strategy, model_name, prefill_limits, model=model, listen=False
    )
    geometry = PoolGeometry(prefill.layout, decode.max_batch, decode.max_tokens)
    connect = inproc_connect(prefill, geometry, settings.link_gbps, settings.delay_ms / 1e3)
    try:
        node = build_decode_node(
            settings,
            [INPROC_PEER],
            decode.scheme,
            decode.speculative_ratio,
            model_name,
            decode.max_batch,
            decode.max_tokens,
            decode.max_waiting,
            emulation=decode.emulation(),
            limits=decode.limits,
            model=model,
            connect=connect,
        )
    except BaseException:
        prefill.stop()
        raise
    return ColocatedNode(prefill, node), profile_note
