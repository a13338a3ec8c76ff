"""TLS for the TCP lanes (optional): encrypts every connection and authenticates the nodes by certificate.

The shared-secret handshake still runs inside TLS; TLS adds what it cannot give: confidentiality (prompt ids and KV
no longer cross the network in the clear) and protection from a man in the middle that relays bytes. A prefill node
needs a certificate and key; a decode node verifies it against `ca` (and the address it dials, which the certificate
must name). With `ca` on the prefill node too, decode nodes must present a certificate signed by it (mutual TLS).
One-sided lanes' side channels are covered; their transports' writes (RDMA, Mooncake, NIXL) are not.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TlsFiles"]


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files: this node's certificate chain and key, and the CA that signs its peers' certificates."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("TLS needs --tls-cert and --tls-key together")
        for what, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{what} {path}: no such file")

    def server_context(self) -> ssl.SSLContext:
        """A prefill node's: its certificate; client certificates required when a CA is given."""
        if self.cert is None or self.key is None:
            raise ValueError("a prefill node serving TLS needs --tls-cert and --tls-key")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._load(context)
        if self.ca is not None:
            context.verify_mode = ssl.CERT_REQUIRED  # mutual TLS: only decode nodes with a certificate of this CA
        return context

    def client_context(self) -> ssl.SSLContext:
        """A decode node's: verifies the prefill node against the CA (the system's when none is given)."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._load(context)
        return context

    def _load(self, context: ssl.SSLContext) -> None:
        try:
            if self.cert is not None and self.key is not None:
                context.load_cert_chain(self.cert, self.key)
            if self.ca is not None:
                context.load_verify_locations(cafile=str(self.ca))
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"cannot load the TLS files ({self.cert}, {self.key}, {self.ca}): {exc}") from exc
