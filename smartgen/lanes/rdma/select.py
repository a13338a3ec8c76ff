"""Chooses the RDMA device, port and GID index from what the verbs report: pure, so it is tested without a NIC."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

__all__ = [
    "PortInfo",
    "GidInfo",
    "Choice",
    "RdmaOptions",
    "choose_port",
    "choose_gid",
    "negotiate_mtu",
    "describe_port",
    "MTU_BYTES",
]

PORT_ACTIVE = 4  # IBV_PORT_ACTIVE
LINK_INFINIBAND, LINK_ETHERNET = 1, 2  # IBV_LINK_LAYER_*
GID_ROCE_V1, GID_ROCE_V2 = 0, 1  # IBV_GID_TYPE_ROCE_V1 / _V2 (IB ports report 0 too)
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}  # IBV_MTU_* enum -> bytes
PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}  # IBV_PORT_*
LINK_LAYERS = {0: "InfiniBand", LINK_INFINIBAND: "InfiniBand", LINK_ETHERNET: "Ethernet"}  # 0: unspecified = IB


@dataclass(frozen=True, slots=True)
class PortInfo:
    device: str
    port: int
    state: int
    link_layer: int
    active_mtu: int  # IBV_MTU_* enum


@dataclass(frozen=True, slots=True)
class GidInfo:
    index: int
    gid: str  # "fe80:0000:..." as pyverbs prints it
    gid_type: int


@dataclass(frozen=True, slots=True)
class RdmaOptions:
    """The device, port and GID index asked for (`serve --rdma-device --rdma-port --gid-index`); None: chosen here."""

    device: str | None = None
    port: int | None = None
    gid_index: int | None = None


@dataclass(frozen=True, slots=True)
class Choice:
    device: str
    port: int


def choose_port(ports: list[PortInfo], device: str | None = None, port: int | None = None) -> Choice:
    """The one active port that matches the request; a clear error when there are none or several."""
    if not ports:
        raise RuntimeError("no RDMA device: the verbs list no devices (no NIC, driver or Soft-RoCE link)")
    names = sorted({p.device for p in ports})
    if device is not None and device not in names:
        raise RuntimeError(f"no RDMA device {device!r}; this machine has {', '.join(names)}")
    matches = [p for p in ports if (device is None or p.device == device) and (port is None or p.port == port)]
    if not matches:
        raise RuntimeError(f"{device or 'no device'} has no port {port}")
    active = [p for p in matches if p.state == PORT_ACTIVE]
    if not active:
        listed = ", ".join(f"{p.device}:{p.port}" for p in matches)
        raise RuntimeError(f"no active RDMA port among {listed} (check the link, or `rdma link` for Soft-RoCE)")
    if len(active) > 1:
        listed = ", ".join(f"{p.device}:{p.port}" for p in active)
        raise RuntimeError(f"several active RDMA ports ({listed}): pick one with --rdma-device and --rdma-port")
    return Choice(active[0].device, active[0].port)


def _ipv4_mapped(gid: str) -> bool:
    try:
        return ipaddress.IPv6Address(gid).ipv4_mapped is not None
    except ValueError:
        return False


def choose_gid(gids: list[GidInfo], link_layer: int, index: int | None = None) -> int:
    """The GID index to use: the requested one if it exists; on InfiniBand 0; on RoCE the RoCE v2 IPv4 GID.

    RoCE v2 with an IPv4-mapped GID routes over UDP/IP, which is what cloud RoCE networks carry;
    a link-local (fe80::) or v1 GID only works inside one L2 segment.
    """
    present = [g for g in gids if int(ipaddress.IPv6Address(g.gid)) != 0]
    if index is not None:
        if not any(g.index == index for g in present):
            raise RuntimeError(f"GID index {index} is empty; valid: {[g.index for g in present]}")
        return index
    if not present:
        raise RuntimeError("the port has no GID (is the interface up and does it have an address?)")
    if link_layer == LINK_INFINIBAND:
        return min(g.index for g in present)
    ranked = sorted(present, key=lambda g: (g.gid_type != GID_ROCE_V2, not _ipv4_mapped(g.gid), g.index))
    best = ranked[0]
    if best.gid_type != GID_ROCE_V2 or not _ipv4_mapped(best.gid):
        alternatives = [
            g for g in ranked if (g.gid_type, _ipv4_mapped(g.gid)) == (best.gid_type, _ipv4_mapped(best.gid))
        ]
        if len(alternatives) > 1:
            raise RuntimeError(
                f"no RoCE v2 IPv4 GID and several candidates {[g.index for g in alternatives]}: pass --gid-index"
            )
    return best.index


def negotiate_mtu(local: int, remote: int) -> int:
    """The path MTU both ends support (IBV_MTU_* enums: the smaller)."""
    if local not in MTU_BYTES or remote not in MTU_BYTES:
        raise ValueError(f"bad MTU enum {local} or {remote}")
    return min(local, remote)


def describe_port(row: dict) -> dict:
    """One port as `smartgen info` shows it: states, link layer, MTU and GID types in words, and the GID index the
    lane would pick by itself (None, with `gid_choice` saying why, when it would ask for --gid-index)."""
    link_layer = int(row["link_layer"])
    ethernet = link_layer == LINK_ETHERNET
    gids = [GidInfo(g["index"], g["gid"], g["type"]) for g in row["gids"]]
    try:
        chosen: int | None = choose_gid(gids, link_layer)
        why = f"index {chosen}"
    except RuntimeError as exc:
        chosen, why = None, str(exc)
    return {
        "device": row["device"],
        "port": row["port"],
        "state": PORT_STATES.get(int(row["state"]), str(row["state"])),
        "link_layer": LINK_LAYERS.get(link_layer, str(link_layer)),
        "active_mtu": MTU_BYTES.get(int(row["active_mtu"]), 0),
        "gids": [
            {
                "index": g.index,
                "gid": g.gid,
                "type": ("RoCE v2" if g.gid_type == GID_ROCE_V2 else "RoCE v1") if ethernet else "IB",
            }
            for g in gids
        ],
        "gid_choice": chosen,
        "gid_choice_reason": why,
    }
