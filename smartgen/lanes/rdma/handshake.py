"""What two RC queue pairs swap over the authenticated side channel (LANE_INFO), checked before any QP changes state."""

from __future__ import annotations

import ipaddress
import secrets
from dataclasses import asdict, dataclass
from enum import IntEnum
from typing import Any

from smartgen.lanes.rdma.select import MTU_BYTES, negotiate_mtu

__all__ = ["QpInfo", "QpRole", "random_psn", "rtr_settings", "endpoint_meta", "endpoint_infos"]

MAX_24BIT = 2**24


class QpRole(IntEnum):
    """An endpoint's queue pairs: MAIN carries WRITEs and messages in one ordered stream; REPLY carries only the
    fetch replies that land in place, so its receive queue holds nothing but their scatter lists."""

    MAIN = 0
    REPLY = 1


@dataclass(frozen=True, slots=True)
class QpInfo:
    """One end's queue pair: number, first packet sequence number, LID (InfiniBand), GID (RoCE), MTU enum."""

    qpn: int
    psn: int
    lid: int
    gid: str
    gid_index: int
    mtu: int
    link_layer: int

    def __post_init__(self) -> None:
        if not (0 < self.qpn < MAX_24BIT and 0 <= self.psn < MAX_24BIT and 0 <= self.lid < 2**16):
            raise ValueError(f"bad queue pair info {self}")
        if self.mtu not in MTU_BYTES:
            raise ValueError(f"bad MTU enum {self.mtu}")
        ipaddress.IPv6Address(self.gid)  # raises on a malformed GID

    def to_meta(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> QpInfo:
        try:
            return cls(**{name: meta[name] for name in cls.__dataclass_fields__})
        except (KeyError, TypeError) as exc:
            raise ValueError(f"peer sent incomplete queue pair info: {exc}") from exc


def random_psn() -> int:
    return secrets.randbelow(MAX_24BIT)


def rtr_settings(local: QpInfo, remote: QpInfo) -> dict[str, Any]:
    """The RESET->INIT->RTR->RTS parameters both ends derive the same way from the two infos."""
    if local.link_layer != remote.link_layer:
        raise ValueError(f"link layers differ: {local.link_layer} here, {remote.link_layer} at the peer")
    return {
        "path_mtu": negotiate_mtu(local.mtu, remote.mtu),
        "dest_qp_num": remote.qpn,
        "rq_psn": remote.psn,
        "sq_psn": local.psn,
        "dlid": remote.lid,
        "dgid": remote.gid,
        "sgid_index": local.gid_index,
        "is_global": local.link_layer == 2 or remote.lid == 0,  # RoCE always routes by GID
    }


def endpoint_meta(qps: dict[QpRole, QpInfo]) -> dict[str, Any]:
    """LANE_INFO's body for an endpoint: its queue pairs in role order."""
    return {"qps": [qps[role].to_meta() for role in QpRole]}


def endpoint_infos(meta: dict[str, Any]) -> dict[QpRole, QpInfo]:
    """The peer's queue pairs from its LANE_INFO; ValueError when one is missing or malformed."""
    qps = meta.get("qps")
    if not isinstance(qps, list) or len(qps) != len(QpRole) or not all(isinstance(q, dict) for q in qps):
        raise ValueError(f"peer sent {qps!r} for its queue pairs, not {len(QpRole)} of them")
    return {role: QpInfo.from_meta(q) for role, q in zip(QpRole, qps)}
