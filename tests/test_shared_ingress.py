"""The decode node's shared ingress link (lanes/ingress.py): two prefill nodes pushing at once into one decode node
over real loopback TCP take at least all their bytes / the ingress rate, not half of it; the bytes land intact."""

from __future__ import annotations

import shutil
import ssl
import threading
import time
from pathlib import Path

import pytest
import torch

from smartgen.lanes import WriteOp
from smartgen.lanes.ingress import IngressSocket
from smartgen.lanes.link import LinkEnd
from smartgen.lanes.pacer import Pacer
from smartgen.lanes.rate import bytes_per_second
from smartgen.lanes.tcp_link import TcpListener, tcp_connect
from smartgen.lanes.tls import TlsFiles
from smartgen.roles.launch import NodeSettings
from smartgen.roles.serve_settings import ServeSettings

IDENTITY = {"fingerprint": "f00d", "model": "tiny", "layout": None}
SECRET = "s"
INGRESS_GBPS = 0.2  # 25 MB/s: a few MB take a fraction of a second
PUSH_BYTES = 3 * 2**20  # per prefill node


def _connect_two(
    ingress: Pacer | None, tls: tuple[ssl.SSLContext, ssl.SSLContext] | None = None
) -> tuple[list[TcpListener], list[LinkEnd], list[LinkEnd]]:
    """Two unpaced prefill ends (each its own listener, as two nodes) and the decode node's two links to them;
    `tls`: (server, client) contexts to wrap the connections in."""
    server, client = tls if tls is not None else (None, None)
    listeners = [TcpListener("127.0.0.1", 0, SECRET, IDENTITY, tls=server) for _ in range(2)]
    decode_ends, prefill_ends = [], []
    for listener in listeners:
        decode_ends.append(tcp_connect(*listener.address, SECRET, IDENTITY, ingress=ingress, tls=client))
        accepted = listener.accept(timeout=10)
        assert accepted is not None, list(listener.rejections)
        prefill_ends.append(accepted[0])
    return listeners, prefill_ends, decode_ends


def _push_together(prefill_ends: list[LinkEnd], decode_ends: list[LinkEnd]) -> tuple[float, list[torch.Tensor]]:
    """Both prefill ends push PUSH_BYTES at once; the seconds until both are applied, and the decode regions."""
    regions = []
    for i, end in enumerate(decode_ends):
        region = torch.zeros(PUSH_BYTES, dtype=torch.uint8)
        end.push.register_region("kv", region)
        end.push.accept(f"r{i}")
        regions.append(region)
    sources = [torch.randint(0, 255, (PUSH_BYTES,), dtype=torch.uint8) for _ in prefill_ends]
    go = threading.Barrier(len(prefill_ends) + 1)
    done: list = [None] * len(prefill_ends)

    def push(i: int) -> None:
        go.wait()
        # 64 KiB writes, as a layer's blocks go: many frames from each node, interleaved on the ingress link
        ops = [WriteOp("s", "kv", at, at, 64 * 1024) for at in range(0, PUSH_BYTES, 64 * 1024)]
        done[i] = prefill_ends[i].push.post_writes(f"r{i}", {"s": sources[i]}, ops, tag="t")

    threads = [threading.Thread(target=push, args=(i,)) for i in range(len(prefill_ends))]
    for thread in threads:
        thread.start()
    go.wait()
    start = time.monotonic()
    for thread in threads:
        thread.join()
    assert all(d.wait(30) and d.applied for d in done)
    elapsed = time.monotonic() - start
    for region, source in zip(regions, sources):
        assert torch.equal(region, source)
    return elapsed, regions


def _close(*groups) -> None:
    for group in groups:
        for thing in group:
            thing.close()


def test_two_prefill_nodes_into_one_shared_ingress_take_all_their_bytes_over_its_rate():
    ingress = Pacer(INGRESS_GBPS)
    listeners, prefill_ends, decode_ends = _connect_two(ingress)
    try:
        elapsed, _ = _push_together(prefill_ends, decode_ends)
    finally:
        _close(decode_ends, prefill_ends, listeners)
    floor = 2 * PUSH_BYTES / bytes_per_second(INGRESS_GBPS)
    # a lower bound only (a loaded machine is slower, never faster); the pacer lets its clock lag 2 ms behind
    assert elapsed >= floor - 0.01, f"{elapsed:.3f} s for {2 * PUSH_BYTES} bytes; the shared link needs {floor:.3f} s"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_a_shared_ingress_paces_tls_links_too(tmp_path: Path):
    from test_tls import _self_signed

    cert, key = _self_signed(tmp_path, "prefill")
    tls = (TlsFiles(cert, key).server_context(), TlsFiles(ca=cert).client_context())
    listeners, prefill_ends, decode_ends = _connect_two(Pacer(INGRESS_GBPS), tls)
    try:
        assert all(isinstance(end.push._sock, ssl.SSLSocket) for end in decode_ends)  # type: ignore[attr-defined]
        elapsed, _ = _push_together(prefill_ends, decode_ends)
    finally:
        _close(decode_ends, prefill_ends, listeners)
    assert elapsed >= 2 * PUSH_BYTES / bytes_per_second(INGRESS_GBPS) - 0.01


def test_an_ingress_socket_paces_every_read_call_and_keeps_the_wrapped_sockets_class():
    left, right = __import__("socket").socketpair()
    pacer = Pacer(INGRESS_GBPS)
    paced = IngressSocket(left, pacer)
    try:
        assert isinstance(paced, type(left)) and not isinstance(paced, ssl.SSLSocket)
        right.sendall(b"x" * 40_000)
        got = bytearray(40_000)
        view = memoryview(got)
        read = 0
        start = time.monotonic()
        while read < len(got):
            n = paced.recv_into(view[read:]) if read % 2 == 0 else paced.recvmsg_into([view[read:]])[0]
            assert 0 < n <= pacer.chunk_bytes()  # one chunk of link time per call at most
            read += n
        assert time.monotonic() - start >= 40_000 / bytes_per_second(INGRESS_GBPS) - 0.01
        right.sendall(b"yz")
        assert paced.recv(10) == b"yz"
    finally:
        left.close()
        right.close()


def test_an_ingress_link_needs_a_rate():
    left, right = __import__("socket").socketpair()
    try:
        with pytest.raises(ValueError, match="rate"):
            IngressSocket(left, Pacer(None))
    finally:
        left.close()
        right.close()


@pytest.mark.parametrize(
    ("role", "lane", "gbps", "says"),
    [
        ("prefill", "tcp", 1.0, "--role prefill"),
        ("both", "inproc", 1.0, "--role both"),
        ("decode", "mooncake", 1.0, "--lane mooncake"),
        ("decode", "tcp", float("inf"), "positive rate"),
    ],
)
def test_serve_refuses_an_ingress_link_it_cannot_pace_in_one_line(role, lane, gbps, says, tmp_path):
    settings = ServeSettings(role, NodeSettings(tmp_path, lane=lane), ingress_gbps=gbps, insecure=True)
    with pytest.raises(ValueError, match="--ingress-gbps") as refused:
        settings.check()
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_serve_takes_an_ingress_link_on_a_decode_node_over_tcp(tmp_path):
    ServeSettings("decode", NodeSettings(tmp_path), ingress_gbps=25.0, insecure=True).check()


def test_connections_behind_a_shared_ingress_keep_a_small_receive_buffer():
    """What the kernel buffers is out of reach of the sender's priorities (a fetch reply behind bulk pushes): behind a
    shared ingress each connection's receive buffer holds about 10 ms of the link, not the kernel's megabytes."""
    import socket

    from smartgen.lanes.tcp_link import ingress_buffer_bytes

    assert ingress_buffer_bytes(Pacer(0.01)) == 32 * 1024  # 12.5 kB of link in 10 ms: the floor
    assert ingress_buffer_bytes(Pacer(1.0)) == 1_250_000
    assert ingress_buffer_bytes(Pacer(100.0)) == 4 * 1024 * 1024  # the cap
    listeners, prefill_ends, decode_ends = _connect_two(Pacer(INGRESS_GBPS))
    try:
        for end in decode_ends:
            for lane in (end.push, end.control):
                sock = lane._sock  # type: ignore[attr-defined]
                # Linux doubles what is asked for its bookkeeping: still far under its default maximum of megabytes
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) <= 4 * ingress_buffer_bytes(
                    Pacer(INGRESS_GBPS)
                )
    finally:
        for end in prefill_ends + decode_ends:
            end.close()
        for listener in listeners:
            listener.close()
