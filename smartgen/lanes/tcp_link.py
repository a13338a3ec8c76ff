"""TCP links: the prefill node listens, each decode node connects twice (push lane + control/fetch lane).

Both connections of one decode node carry the same session id in their HELLO, so the
listener can pair them into one LinkEnd (`pairing.py`: a connection whose partner never comes
is closed after a while, and only so many may wait). Every connection is authenticated and checked
(protocol version, shared secret, model fingerprint, KV layout) before any data moves.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from smartgen.lanes.auth import client_handshake, server_handshake
from smartgen.lanes.base import Lane
from smartgen.lanes.ingress import IngressSocket
from smartgen.lanes.link import LinkEnd
from smartgen.lanes.liveness import Lease, arm
from smartgen.lanes.pacer import Pacer
from smartgen.lanes.pairing import Pairing, PairingRefused
from smartgen.lanes.tcp import TcpLane
from smartgen.lanes.wire import PROTOCOL_VERSION, HandshakeError

__all__ = ["TcpListener", "tcp_connect", "parse_address", "DEFAULT_HANDSHAKE_TIMEOUT_S"]

CHANNELS = ("push", "control")
# connecting and authenticating one connection takes no longer (`serve --handshake-timeout`): an unauthenticated
# peer holds a socket and a thread no longer than this
DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0
MAX_HANDSHAKES = 16  # connections being authenticated at once (and sessions waiting for a partner); more are closed
MAX_REJECTIONS = 256  # refusals kept for reading (a flood of bad connections must not grow memory)

# Wraps an authenticated socket into a lane endpoint: TcpLane, or a one-sided lane using it as side channel.
LaneFactory = Callable[[socket.socket, str, Pacer, bool], Lane]

log = logging.getLogger(__name__)


def parse_address(text: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """'HOST:PORT' or ':PORT' or 'PORT' -> (host, port), with a clear error."""
    host, _, port = text.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"bad address {text!r}: expected HOST:PORT") from None
    if not 0 <= number < 65536:
        raise ValueError(f"bad port in {text!r}")
    return host or default_host, number


class TcpListener:
    """The prefill node's side: accepts decode nodes; `accept()` returns one paired LinkEnd at a time."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: str,
        identity: dict[str, Any],
        pacer: Pacer | None = None,
        lane_factory: LaneFactory = TcpLane,
        lease: Lease | None = Lease(),
        handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """`tls`: a server context (lanes/tls.py) to wrap every connection in before the handshake; None: plain TCP."""
        self.secret = secret
        self.tls = tls
        self.lease = lease
        self.handshake_timeout_s = handshake_timeout_s
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self.lane_factory = lane_factory
        self.identity = identity
        self.pacer = pacer or Pacer(None)
        self._server = socket.create_server((host, port), reuse_port=False)
        self._server.settimeout(0.2)
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        # the second connection follows the first within a handshake or two; a partner later than that is not coming
        self._pairs = Pairing(CHANNELS, MAX_HANDSHAKES, 2 * handshake_timeout_s)
        self._ready: list[tuple[LinkEnd, dict[str, Any]]] = []
        self._cond = threading.Condition()
        self._closed = threading.Event()
        self.rejections: deque[str] = deque(maxlen=MAX_REJECTIONS)  # the latest refusals, for tests and errors
        self._thread = threading.Thread(target=self._accept_loop, name="tcp-listen", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            self._expire_half_pairs()
            try:
                sock, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._handshakes.acquire(blocking=False):  # a connection flood gets no thread per socket
                with self._cond:
                    self.rejections.append(f"more than {MAX_HANDSHAKES} connections authenticating: closed one")
                sock.close()
                continue
            threading.Thread(target=self._admit, args=(sock,), daemon=True).start()

    def _admit(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(self.handshake_timeout_s)  # bounds the TLS handshake too
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_side=True)
            hello = server_handshake(sock, self.secret, self.identity)
        except Exception as exc:  # whatever a stranger sends, the listener answers with a logged refusal
            with self._cond:
                self.rejections.append(
                    f"{type(exc).__name__}: {exc}" if not isinstance(exc, HandshakeError) else str(exc)
                )
            log.warning("refused a connection: %s", exc)
            sock.close()
            return
        finally:
            self._handshakes.release()
        arm(sock, self.lease)
        channel = hello.get("channel")
        session = str(hello.get("session"))
        if channel not in CHANNELS:
            sock.close()
            return
        try:
            lane = self.lane_factory(sock, f"prefill.{channel}.{session[:8]}", self.pacer, channel == "push")
        except (OSError, ConnectionError, ImportError) as exc:
            with self._cond:
                self.rejections.append(f"{channel} lane did not come up: {exc}")
            sock.close()
            return
        with self._cond:
            try:
                pair = self._pairs.add(session, channel, lane)
            except PairingRefused as exc:
                self.rejections.append(str(exc))
                refused: PairingRefused | None = exc
            else:
                refused = None
                if pair is not None:
                    self._ready.append((LinkEnd(pair["push"], pair["control"], self.pacer), hello))
                    self._cond.notify_all()
        if refused is not None:
            log.warning("refused a connection: %s", refused)
            lane.close()

    def _expire_half_pairs(self) -> None:
        """Closes the connections whose partner did not come in time (or that closed while waiting)."""
        with self._cond:
            stale = self._pairs.expire()
            self.rejections.extend(reason for reason, _ in stale)
        for reason, lane in stale:
            log.warning("closed an unpaired connection: %s", reason)
            lane.close()

    @property
    def num_unpaired(self) -> int:
        """Sessions that have one connection up and wait for the other."""
        with self._cond:
            return len(self._pairs)

    def accept(self, timeout: float | None = None) -> tuple[LinkEnd, dict[str, Any]] | None:
        """The next connected decode node (its LinkEnd and HELLO), or None after `timeout`."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready or self._closed.is_set(), timeout):
                return None
            if not self._ready:
                return None
            return self._ready.pop(0)

    def close(self) -> None:
        self._closed.set()
        self._server.close()
        with self._cond:
            self._cond.notify_all()
            halves = self._pairs.drain()
        for lane in halves:
            lane.close()


def tcp_connect(
    host: str,
    port: int,
    secret: str,
    hello: dict[str, Any],
    gbps: float | None = None,
    delay_s: float = 0.0,
    timeout: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
    version: int = PROTOCOL_VERSION,
    lane_factory: LaneFactory = TcpLane,
    lease: Lease | None = Lease(),
    tls: ssl.SSLContext | None = None,
    ingress: Pacer | None = None,
) -> LinkEnd:
    """The decode node's side: two authenticated connections to one prefill node, as a LinkEnd.

    `timeout` bounds connecting and each step of the handshake (then the lease takes over). `tls`: a client context
    (lanes/tls.py); the prefill node's certificate must then name `host`. `ingress`: the node's shared ingress link
    (lanes/ingress.py): what both connections read after the handshake crosses it, with every other link's reads."""
    session = uuid.uuid4().hex
    pacer = Pacer(gbps, delay_s)
    lanes = {}
    try:
        for channel in CHANNELS:
            sock = _connect(host, port, timeout, ingress)
            try:
                if tls is not None:
                    sock = tls.wrap_socket(sock, server_hostname=host)
                client_handshake(sock, secret, {**hello, "channel": channel, "session": session}, version=version)
            except (TimeoutError, ssl.SSLError) as exc:
                sock.close()
                raise _tls_hint(exc, tls is not None) from exc
            except BaseException:
                sock.close()
                raise
            arm(sock, lease)
            if ingress is not None and ingress.gbps is not None:
                sock = IngressSocket(sock, ingress)  # type: ignore[assignment]  # a socket in all but its reads
            try:
                # the push lane is bulk at this end too: its receive thread lands pushes, throughput work
                lanes[channel] = lane_factory(sock, f"decode.{channel}.{session[:8]}", pacer, channel == "push")
            except BaseException:
                sock.close()
                raise
    except BaseException:
        for lane in lanes.values():
            lane.close()
        raise
    return LinkEnd(lanes["push"], lanes["control"], pacer)


def ingress_buffer_bytes(pacer: Pacer) -> int:
    """The receive buffer of a connection behind a shared ingress: about 10 ms of the link (32 KiB to 4 MiB). What the
    kernel buffers waits there in arrival order, out of reach of the sender's priorities (a fetch reply behind bulk
    pushes); a switch port's buffer is small too, and TCP's window then holds the senders back in their own queues."""
    rate = pacer.bytes_per_second or 0.0
    return int(min(max(rate * 0.010, 32 * 1024), 4 * 1024 * 1024))


def _connect(host: str, port: int, timeout: float, ingress: Pacer | None) -> socket.socket:
    """A TCP connection; behind a shared ingress, with a receive buffer set before connecting (`ingress_buffer_bytes`:
    the window is agreed at the handshake)."""
    if ingress is None or ingress.gbps is None:
        return socket.create_connection((host, port), timeout=timeout)
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, ingress_buffer_bytes(ingress))
        sock.settimeout(timeout)
        sock.connect(address)
    except BaseException:
        sock.close()
        raise
    return sock


def _tls_hint(exc: OSError, tls: bool) -> OSError:
    """A TLS mismatch shows as a silent peer (plain client, TLS server) or a protocol error: say what to check."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return exc  # says itself what is wrong with the certificate
    if isinstance(exc, ssl.SSLError):
        return ConnectionError(f"TLS: {exc.reason or exc}: does the prefill node serve TLS (--tls-cert/--tls-key)?")
    if not tls:
        return TimeoutError(f"{exc} waiting for the handshake: if the prefill node serves TLS, give --tls-ca")
    return exc


def loopback_tcp_link(
    gbps: float | None = None, delay_s: float = 0.0, secret: str = "loopback", lane_factory: LaneFactory = TcpLane
) -> tuple[LinkEnd, LinkEnd]:
    """A real link over 127.0.0.1 (port 0) inside one process; returns (prefill end, decode end)."""
    identity = {"fingerprint": "loopback", "model": "loopback", "layout": None}
    listener = TcpListener("127.0.0.1", 0, secret, identity, Pacer(gbps, delay_s), lane_factory)
    try:
        host, port = listener.address
        decode_end = tcp_connect(host, port, secret, identity, gbps=gbps, delay_s=delay_s, lane_factory=lane_factory)
        accepted = listener.accept(timeout=10)
        if accepted is None:
            decode_end.close()
            raise ConnectionError("loopback TCP link did not come up: " + "; ".join(listener.rejections))
        return accepted[0], decode_end
    finally:
        listener.close()
