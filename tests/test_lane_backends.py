"""Lane backends by name: write planning for one-sided transports, missing extras, bad descriptors."""

import gc
import socket
import struct
import subprocess
import sys
import weakref

import pytest
import torch
from conftest import lane_available
from hypothesis import given
from hypothesis import strategies as st

from smartgen.lanes import WriteOp
from smartgen.lanes.backends import lane_factory, loopback_link
from smartgen.lanes.extras import MissingExtra, require
from smartgen.lanes.transport import Segment, TransportError
from smartgen.lanes.write_plan import chunk_ops, region_runs

ops_strategy = st.lists(
    st.builds(
        WriteOp,
        st.sampled_from(["a", "b"]),
        st.sampled_from(["k", "v", "mask"]),
        st.integers(0, 10_000),
        st.integers(0, 10_000),
        st.integers(1, 5_000),
    ),
    max_size=20,
)


def _byte_map(ops):
    return [(op.src, op.dst, op.src_offset + i, op.dst_offset + i) for op in ops for i in range(op.length)]


@given(ops_strategy, st.integers(1, 7_000))
def test_chunks_move_the_same_bytes_in_the_same_order(ops, chunk_bytes):
    chunks = chunk_ops(ops, chunk_bytes)
    assert all(0 < sum(op.length for op in chunk) <= chunk_bytes for chunk in chunks)
    assert _byte_map([op for chunk in chunks for op in chunk]) == _byte_map(ops)


def test_region_runs_fence_data_before_mask():
    ops = [
        WriteOp("s", "k", 0, 0, 1),
        WriteOp("s", "k", 1, 1, 1),
        WriteOp("s", "v", 0, 0, 1),
        WriteOp("o", "mask", 0, 0, 1),
    ]
    assert region_runs(list(range(4)), ops) == [[0, 1], [2], [3]]


def test_a_missing_package_names_the_extra():
    with pytest.raises(MissingExtra, match=r"pip install 'smartgen\[mooncake\]'"):
        require("no_such_module_here", "mooncake")
    with pytest.raises(ValueError, match="unknown lane"):
        lane_factory("carrier-pigeon")


def test_the_base_package_imports_without_the_lane_packages():
    blocked = "import sys\nfor name in ('mooncake', 'nixl', 'pyverbs'): sys.modules[name] = None\n"
    script = blocked + (
        "import smartgen.lanes, smartgen.lanes.backends as b, smartgen.lanes.mooncake, smartgen.lanes.nixl\n"
        "for name in ('mooncake', 'nixl', 'rdma'): print(b.unavailable(name))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for line, extra in zip(lines, ("mooncake", "nixl", "rdma")):
        assert f"pip install 'smartgen[{extra}]'" in line


@pytest.mark.parametrize("bad", [WriteOp("s", "nowhere", 0, 0, 8), WriteOp("s", "kv", 0, 60, 8)])
def test_a_bad_descriptor_fails_its_batch_not_the_lane(socket_lane_kind, bad):
    prefill, decode = loopback_link(socket_lane_kind)
    try:
        region = torch.zeros(64, dtype=torch.uint8)
        decode.push.register_region("kv", region)
        decode.push.accept("r")
        src = torch.ones(8, dtype=torch.uint8)
        done = prefill.push.post_writes("r", {"s": src}, [bad], tag="t")
        assert done.wait(5) and not done.applied
        done = prefill.push.post_writes("r", {"s": src}, [WriteOp("s", "kv", 0, 0, 8)], tag="t")
        assert done.wait(5) and done.applied and int(region.sum()) == 8
    finally:
        prefill.close()
        decode.close()


def test_rdma_choices_go_to_the_rdma_lane_only():
    from smartgen.lanes.rdma.select import RdmaOptions

    assert lane_factory("tcp", rdma=RdmaOptions()) is lane_factory("tcp")  # nothing asked: fine anywhere
    with pytest.raises(ValueError, match="--lane rdma only, not mooncake"):
        lane_factory("mooncake", rdma=RdmaOptions(device="mlx5_0"))


@pytest.mark.parametrize("name", ["mooncake", "nixl"])
def test_closing_a_transport_lets_its_engine_go_at_once(name):
    """close() lets go of the Mooncake engine or NIXL agent itself, not the garbage collector some time later: until
    then a NIXL agent's progress thread kept polling and a Mooncake engine's servers kept taking connections."""
    lane_available(name)
    if name == "mooncake":
        from smartgen.lanes.mooncake import MooncakeTransport

        transport, peer = MooncakeTransport(), MooncakeTransport()
    else:
        from smartgen.lanes.nixl import NixlTransport

        transport, peer = NixlTransport(), NixlTransport()
    try:
        transport.connect(peer.info())
        region = torch.zeros(64, dtype=torch.uint8)
        transport.register(region)
        engine = weakref.ref(transport._engine if name == "mooncake" else transport._agent)
        gc.disable()  # what lets it go must be close() dropping the last reference, not a collection
        try:
            transport.close()
            transport.close()  # a second close does nothing
            assert engine() is None
        finally:
            gc.enable()
        with pytest.raises(TransportError, match="closed"):
            transport.write([Segment(region.data_ptr(), region.data_ptr(), 8, None, None)])
        if name == "mooncake":  # its RPC server (the peer's handshake) is gone with it
            host, port = transport.info()["session"].rsplit(":", 1)
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((host, int(port)), timeout=5).close()
    finally:
        transport.close()
        peer.close()


def test_a_mooncake_engines_handshake_listener_wakes_every_50_ms():
    """Mooncake's destructor holds the GIL until its handshake listener's accept() times out (1 s as Mooncake sets
    it): the transport shortens that timeout, so closing a lane stalls its process for about 50 ms, not a second."""
    lane_available("mooncake")
    from smartgen.lanes.mooncake import ACCEPT_TIMEOUT_S, MooncakeTransport, _listener_of

    transport = MooncakeTransport()
    try:
        listener = _listener_of(int(transport.info()["session"].rsplit(":", 1)[1]))
        assert listener is not None
        with listener:
            seconds, micros = struct.unpack("ll", listener.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16))
        assert seconds + micros / 1e6 == pytest.approx(ACCEPT_TIMEOUT_S, abs=0.01)  # the kernel rounds to its tick
    finally:
        transport.close()
