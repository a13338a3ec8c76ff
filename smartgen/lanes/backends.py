"""Lane backends by name, imported lazily: in-process, TCP, and the one-sided Mooncake, NIXL and RDMA lanes."""

from __future__ import annotations

import functools
import importlib

import torch

from smartgen.lanes.extras import MissingExtra
from smartgen.lanes.link import LinkEnd, inproc_link
from smartgen.lanes.onesided import OneSidedTimeouts
from smartgen.lanes.rdma.select import RdmaOptions
from smartgen.lanes.tcp_link import LaneFactory, loopback_tcp_link

__all__ = ["LANES", "INPROC", "lane_factory", "unavailable", "lane_problem", "lands_in_device_memory", "loopback_link"]

# name -> "module:factory"; every factory wraps an authenticated socket (see tcp_link.LaneFactory)
LANES = {
    "tcp": "smartgen.lanes.tcp:TcpLane",
    "mooncake": "smartgen.lanes.mooncake:mooncake_lane",
    "nixl": "smartgen.lanes.nixl:nixl_lane",
    "rdma": "smartgen.lanes.rdma.lane:rdma_lane",
}

# the one-sided lanes' transports: "module:class"
TRANSPORTS = {
    "mooncake": "smartgen.lanes.mooncake:MooncakeTransport",
    "nixl": "smartgen.lanes.nixl:NixlTransport",
    "rdma": "smartgen.lanes.rdma.lane:RdmaTransport",
}

# the lane of a colocated node (`serve --role both`): in-process, paced like the socket lanes; no factory
INPROC = "inproc"


def lane_factory(name: str, timeouts: OneSidedTimeouts | None = None, rdma: RdmaOptions | None = None) -> LaneFactory:
    """The factory for a lane by name; MissingExtra (naming the extra) when its package is not installed.

    `timeouts`: how long a one-sided lane waits on its peer (None: the defaults; the TCP lane has no such waits).
    `rdma`: the RDMA device, port and GID index asked for (the rdma lane only; None: chosen automatically)."""
    if name not in LANES:
        raise ValueError(f"unknown lane {name!r}; choose one of {', '.join(LANES)}")
    if rdma is not None and rdma != RdmaOptions() and name != "rdma":
        raise ValueError(f"--rdma-device, --rdma-port and --gid-index apply to --lane rdma only, not {name}")
    module, attr = LANES[name].split(":")
    factory = getattr(importlib.import_module(module), attr)
    if name == "rdma" and rdma is not None:
        factory = importlib.import_module(module).rdma_lane_for(rdma)
    if timeouts is None or name == "tcp":
        return factory
    return functools.partial(factory, timeouts=timeouts)


def unavailable(name: str) -> str | None:
    """Why a lane cannot run on this machine (a missing package or device), or None when it can."""
    if name in ("inproc", "tcp"):
        return None
    try:
        if name == "mooncake":
            from smartgen.lanes.mooncake import MooncakeTransport

            MooncakeTransport.probe()
        elif name == "nixl":
            from smartgen.lanes.nixl import NixlTransport

            NixlTransport.probe()
        elif name == "rdma":
            from smartgen.lanes.rdma.device import probe

            probe()
        else:
            return f"unknown lane {name!r}"
    except (MissingExtra, RuntimeError, OSError) as exc:
        return str(exc)
    return None


def lane_problem(name: str) -> str | None:
    """What is wrong with `--lane name` for the nodes of `serve`, `bench` or `demo` (one line), or None."""
    if name != INPROC and name not in LANES:
        return f"--lane must be one of {', '.join(LANES)} or {INPROC} (both nodes in one process), got {name!r}"
    missing = unavailable(name)
    return f"--lane {name} cannot run here: {missing}" if missing else None


def lands_in_device_memory(name: str, device: torch.device) -> bool:
    """Whether lane `name` lands writes in regions on `device` itself: always for in-process and TCP (their
    receiving side copies into them), for a one-sided lane when its transport registers that memory here."""
    if device.type == "cpu" or name not in TRANSPORTS:
        return True
    module, attr = TRANSPORTS[name].split(":")
    transport = getattr(importlib.import_module(module), attr)
    return bool(transport.registers_device_memory(device))


def loopback_link(name: str, gbps: float | None = None, delay_s: float = 0.0) -> tuple[LinkEnd, LinkEnd]:
    """Both ends of a link of this kind inside one process, over 127.0.0.1; returns (prefill end, decode end)."""
    if name == "inproc":
        return inproc_link(gbps, delay_s)
    return loopback_tcp_link(gbps, delay_s, lane_factory=lane_factory(name))
