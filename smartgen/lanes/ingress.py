"""A node's shared ingress link: every byte it reads from its peers' sockets crosses one paced link.

`serve --role decode --ingress-gbps G` emulates the decode node's one NIC that all its prefill
nodes send into (the paper's DP 6 -> 1): each socket of each link is wrapped in an `IngressSocket`
that books the shared `Pacer` for what it has just read and sleeps until those bytes have crossed
it. A read takes at most one pacer chunk (about 2 ms of link time), so the socket buffers fill,
TCP's flow control holds every sender back together, and n bytes from any number of senders take
at least n / rate seconds to arrive, whichever prefill node sent them. Arrival order across links
is first come, first served, as at a switch port without QoS: the receiving end cannot tell an
on-demand fetch reply from a bulk push before it has read it.

Only the lanes whose data crosses these sockets are paced here (the tcp lane); a one-sided lane
moves its data outside them, and `ServeSettings.check` refuses the option with it.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from typing import Any

from smartgen.lanes.pacer import Pacer, sleep_until

__all__ = ["IngressSocket"]


class IngressSocket:
    """Wraps a connected socket (plain or TLS) so that its reads are paced by a pacer shared with other sockets.

    Everything but the reads is the wrapped socket's own (send, settimeout, shutdown, fileno...), and isinstance
    sees the wrapped socket's class, so code that treats TLS sockets apart (no vectored reads, Python timeouts)
    still does."""

    def __init__(self, sock: socket.socket, pacer: Pacer) -> None:
        if pacer.gbps is None:
            raise ValueError("an ingress link needs a rate (Gbit/s)")
        self._sock = sock
        self._pacer = pacer

    @property  # type: ignore[misc]  # isinstance() consults __class__: the lanes' TLS checks see the real socket
    def __class__(self) -> type:
        return type(self._sock)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    @property
    def pacer(self) -> Pacer:
        return self._pacer

    def _crossed(self, num_bytes: int) -> None:
        """`num_bytes` were just read: they are handed on once the shared link has carried them."""
        if num_bytes > 0:
            sleep_until(self._pacer.reserve(num_bytes))

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        data = self._sock.recv(min(bufsize, self._pacer.chunk_bytes()), flags)
        self._crossed(len(data))
        return data

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        view = memoryview(buffer).cast("B")
        limit = min(nbytes or view.nbytes, view.nbytes, self._pacer.chunk_bytes())
        received = self._sock.recv_into(view, limit, flags)
        self._crossed(received)
        return received

    def recvmsg_into(self, buffers: Iterable[Any], ancbufsize: int = 0, flags: int = 0) -> tuple[int, list, int, Any]:
        room = self._pacer.chunk_bytes()
        limited: list[memoryview] = []
        for buffer in buffers:  # the first `room` bytes of the buffers, in order
            view = memoryview(buffer).cast("B")
            limited.append(view[:room])
            room -= limited[-1].nbytes
            if room <= 0:
                break
        result = self._sock.recvmsg_into(limited, ancbufsize, flags)
        self._crossed(result[0])
        return result
