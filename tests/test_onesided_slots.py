"""One-sided lanes (Mooncake, NIXL, RDMA) check every write against the request's slot like the TCP lane does.

Their writes land without the owner's CPU, so the owner sends each request's slot extents with ACCEPT and the
writer's lane drops any descriptor outside them before the transport moves a byte. No RDMA device or lane package is
needed here: the transport below copies memory inside this process (both ends are in it), with the real side
channel, handshake, ACCEPT/REVOKE round trips and write planning of `OneSidedLane` around it.
"""

import ctypes
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from smartgen.lanes import WriteOp
from smartgen.lanes.extents import extents_meta, parse_extents
from smartgen.lanes.onesided import one_sided_factory
from smartgen.lanes.tcp_link import loopback_tcp_link
from smartgen.lanes.transport import Segment, Transport

REGION = 256
SLOT = (64, 128)  # the accepted request's bytes in region "k"


class MemcpyTransport(Transport):
    """Writes are memmoves between addresses of this process: a one-sided transport with no device."""

    name = "memcpy"

    def info(self) -> dict[str, Any]:
        return {}

    def connect(self, peer: dict[str, Any]) -> None:
        pass

    def register(self, tensor: torch.Tensor) -> tuple[Any, Any]:
        return tensor.data_ptr(), 0

    def deregister(self, handle: Any) -> None:
        pass

    def write(self, segments: Sequence[Segment]) -> None:
        for segment in segments:
            ctypes.memmove(segment.dst_addr, segment.src_addr, segment.length)

    def close(self) -> None:
        pass


@pytest.fixture
def ends():
    """(writer's push lane, owner's push lane, owner's region "k"): request "r" accepted in SLOT only."""
    writer, owner = loopback_tcp_link(lane_factory=one_sided_factory(lambda sock, timeouts: MemcpyTransport()))
    region = torch.zeros(REGION, dtype=torch.uint8)
    owner.push.register_region("k", region)
    owner.push.accept("r", {"k": [SLOT]})
    yield writer.push, owner.push, region
    writer.close()
    owner.close()


@pytest.mark.parametrize(
    "request_id,offset,length,why",
    [
        ("r", 0, 8, "inside the region, before the request's slot"),
        ("r", SLOT[1] - 4, 8, "straddling the slot's end"),
        ("r", REGION - 4, 8, "straddling the region's end"),
        ("other", SLOT[0], 8, "a request that was never accepted"),
    ],
)
def test_a_write_outside_the_slot_never_lands_and_the_lane_goes_on(ends, request_id, offset, length, why):
    writer, owner, region = ends
    source = torch.full((REGION,), 7, dtype=torch.uint8)
    # one batch: a good descriptor, then the bad one; only the good one lands, the batch is reported not applied
    ops = [WriteOp("s", "k", 0, SLOT[0], 4), WriteOp("s", "k", 0, offset, length)]
    done = writer.post_writes(request_id, {"s": source}, ops, tag="proactive")
    assert done.wait(30)
    assert not done.applied, why
    landed = region.nonzero().flatten().tolist()
    assert landed == ([] if request_id == "other" else list(range(SLOT[0], SLOT[0] + 4))), why
    # the lane is still up: a write inside the slot lands whole and is reported applied
    good = writer.post_writes("r", {"s": source}, [WriteOp("s", "k", 0, SLOT[0] + 8, 16)], tag="proactive")
    assert good.wait(30) and good.applied
    assert bool((region[SLOT[0] + 8 : SLOT[0] + 24] == 7).all()) and not owner.closed


def test_a_revoked_request_writes_nothing_more(ends):
    writer, owner, region = ends
    owner.revoke("r")
    done = writer.post_writes("r", {"s": torch.ones(8, dtype=torch.uint8)}, [WriteOp("s", "k", 0, SLOT[0], 8)], tag="x")
    assert done.wait(30) and not done.applied
    assert not bool(region.any())


def test_extents_cross_the_wire_checked():
    extents = {"k": [(0, 64), (128, 192)], "mask": [(5, 9)]}
    assert parse_extents(extents_meta(extents)) == extents
    for bad in ([], {"k": "0-64"}, {"k": [[0]]}, {"k": [[0, -1]]}, {"k": [[0, 1.5]]}, {"k": [[True, 3]]}):
        with pytest.raises(ValueError):
            parse_extents(bad)
