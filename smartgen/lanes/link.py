"""A link between one prefill node and one decode node: a push lane and a separate control/fetch lane.

Bulk pushes (proactive, speculative) go on the push lane; fetch requests and replies and
request control go on the other, so a remote fetch is never queued behind bulk pushes.
Both of the prefill node's lanes share one pacer, as they would share a NIC.
"""

from __future__ import annotations

from dataclasses import dataclass

from smartgen.lanes.base import Lane
from smartgen.lanes.inproc import InprocLane
from smartgen.lanes.pacer import Pacer

__all__ = ["LinkEnd", "inproc_link"]


@dataclass(slots=True)
class LinkEnd:
    """One node's end of a link."""

    push: Lane
    control: Lane
    pacer: Pacer

    def close(self) -> None:
        self.push.close()
        self.control.close()

    @property
    def alive(self) -> bool:
        """False once either lane has closed (peer gone, lease expired, bad frame, or closed here)."""
        return not (getattr(self.push, "closed", False) or getattr(self.control, "closed", False))

    @property
    def error(self) -> str | None:
        """Why a lane broke, when one did (lanes that record it)."""
        return getattr(self.control, "error", None) or getattr(self.push, "error", None)


def inproc_link(gbps: float | None = None, delay_s: float = 0.0, name: str = "link") -> tuple[LinkEnd, LinkEnd]:
    """An in-process link paced at `gbps` each way; returns (prefill end, decode end)."""
    prefill_nic = Pacer(gbps, delay_s)
    decode_nic = Pacer(gbps, delay_s)
    push_p, push_d = InprocLane.pair(f"{name}.push", prefill_nic, decode_nic, bulk=True)
    ctl_p, ctl_d = InprocLane.pair(f"{name}.control", prefill_nic, decode_nic)
    return LinkEnd(push_p, ctl_p, prefill_nic), LinkEnd(push_d, ctl_d, decode_nic)
