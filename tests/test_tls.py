"""TLS on the TCP lanes (`--tls-cert/--tls-key/--tls-ca`), with self-signed certificates made here by openssl:
the link works, nothing of the handshake is readable on the wire, and a peer without the right certificate or
without TLS is refused."""

import shutil
import socket
import ssl
import subprocess
import threading
from pathlib import Path

import httpx
import pytest
from conftest import Nodes
from tiny_models import save_tiny_model

from smartgen.lanes import Message, MessageKind
from smartgen.lanes.tcp_link import TcpListener, tcp_connect
from smartgen.lanes.tls import TlsFiles

IDENTITY = {"fingerprint": "f", "model": "m", "layout": [2, 2, 4, "float32", 8]}

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make certs")


def _self_signed(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost (it is its own CA) and its key."""
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}"]
        + ["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("certs")
    return {name: _self_signed(folder, name) for name in ("prefill", "decode", "stranger")}


class _Tap:
    """A TCP relay between a client and `target` that keeps every byte it forwards (what a wiretap would see)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.seen = bytearray()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = self.server.getsockname()[:2]
        self.target = target
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                self.seen += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            sink.close()

    def close(self) -> None:
        self.server.close()


def _link_works(prefill_end, decode_end) -> None:
    decode_end.control.send(Message(MessageKind.IDLE, "r", {"layer": 3}))
    message = prefill_end.control.recv(timeout=10)
    assert message is not None and message.meta == {"layer": 3}


def test_a_tls_link_carries_messages_and_a_wiretap_reads_nothing(certs):
    cert, key = certs["prefill"]
    listener = TcpListener("127.0.0.1", 0, "s", IDENTITY, tls=TlsFiles(cert, key).server_context())
    tap = _Tap(listener.address)
    try:
        decode_end = tcp_connect(*tap.address, "s", IDENTITY, tls=TlsFiles(ca=cert).client_context())
        accepted = listener.accept(timeout=10)
        assert accepted is not None
        _link_works(accepted[0], decode_end)
        decode_end.close()
        accepted[0].close()
        # the HELLO (fingerprint, session, MAC) and the message crossed encrypted
        assert len(tap.seen) > 1000 and b"fingerprint" not in tap.seen and b'"layer"' not in tap.seen
    finally:
        tap.close()
        listener.close()


def test_a_wrong_certificate_or_plain_tcp_is_refused(certs):
    cert, key = certs["prefill"]
    listener = TcpListener("127.0.0.1", 0, "s", IDENTITY, tls=TlsFiles(cert, key).server_context())
    try:
        with pytest.raises(ssl.SSLCertVerificationError):  # the decode node trusts another CA
            tcp_connect(*listener.address, "s", IDENTITY, tls=TlsFiles(ca=certs["stranger"][0]).client_context())
        with pytest.raises(TimeoutError, match="if the prefill node serves TLS, give --tls-ca"):  # no TLS at all
            tcp_connect(*listener.address, "s", IDENTITY, timeout=2)
        assert listener.accept(timeout=0.5) is None
    finally:
        listener.close()
    plain = TcpListener("127.0.0.1", 0, "s", IDENTITY)
    try:
        with pytest.raises(ConnectionError, match="does the prefill node serve TLS"):
            tcp_connect(*plain.address, "s", IDENTITY, tls=TlsFiles(ca=cert).client_context(), timeout=5)
    finally:
        plain.close()


def test_mutual_tls_requires_a_decode_certificate_from_the_prefill_nodes_ca(certs):
    cert, key = certs["prefill"]
    decode_cert, decode_key = certs["decode"]
    server = TlsFiles(cert, key, ca=decode_cert).server_context()
    listener = TcpListener("127.0.0.1", 0, "s", IDENTITY, tls=server)
    try:
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):  # no client certificate
            link = tcp_connect(*listener.address, "s", IDENTITY, tls=TlsFiles(ca=cert).client_context(), timeout=5)
            link.close()
        client = TlsFiles(decode_cert, decode_key, ca=cert).client_context()
        decode_end = tcp_connect(*listener.address, "s", IDENTITY, tls=client)
        accepted = listener.accept(timeout=10)
        assert accepted is not None
        _link_works(accepted[0], decode_end)
        decode_end.close()
        accepted[0].close()
    finally:
        listener.close()


def test_tls_files_are_checked_with_a_clear_error(certs, tmp_path):
    cert, key = certs["prefill"]
    with pytest.raises(ValueError, match="--tls-cert and --tls-key together"):
        TlsFiles(cert=cert)
    with pytest.raises(ValueError, match="no such file"):
        TlsFiles(ca=tmp_path / "missing.pem")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(ValueError, match="cannot load the TLS files"):
        TlsFiles(garbage, key).server_context()
    with pytest.raises(ValueError, match="needs --tls-cert and --tls-key"):
        TlsFiles(ca=cert).server_context()
    from typer.testing import CliRunner

    from smartgen.cli.app import app

    args = ["serve", "--role", "prefill", "--model", "samples/sample-model", "--insecure", "--tls-cert", str(cert)]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "--tls-cert and --tls-key together" in result.stderr, result.output


def test_serve_over_tls_end_to_end(certs, tmp_path):
    """Real `smartgen serve` processes with --tls-cert/--tls-key/--tls-ca on both (one self-signed certificate is
    both nodes' and their CA: mutual TLS): a completion comes back."""
    cert, key = certs["prefill"]
    model_dir = save_tiny_model(tmp_path / "tinym")
    tls = ("--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(cert))
    pair = Nodes(model_dir, tmp_path / "run", extra=("--blocks", "16", "--link-gbps", "1", *tls))
    try:
        pair.wait_ready()
        body = {"prompt": list(range(3, 40)), "max_tokens": 4, "ignore_eos": True}
        answer = httpx.post(pair.url + "/v1/completions", json=body, timeout=120).json()
        assert answer["usage"]["completion_tokens"] == 4, answer
    finally:
        pair.stop()
