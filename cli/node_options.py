"""`serve`'s options between the nodes: a bound on every wait, and the shared secret and TLS that guard the link."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer

from .errors import fail
from .options import option

__all__ = [
    "TIMEOUTS",
    "SECURITY",
    "Lease",
    "HandshakeTimeout",
    "ConfirmTimeout",
    "WriteTimeout",
    "FirstTokenTimeout",
    "QueueTimeout",
    "FetchTimeout",
    "FetchStallMs",
    "StepShare",
    "FlushTimeout",
    "Secret",
    "Insecure",
    "TlsCert",
    "TlsKey",
    "TlsCa",
]

TIMEOUTS, SECURITY = "Timeouts", "Secret and TLS"


def _finite(param: typer.CallbackParam, value: float) -> float:
    if not math.isfinite(value):  # nan passes the range checks and inf means never: neither is a bound
        fail(f"{param.opts[0]} must be a finite number, got {value}")
    return value


# -- Timeouts (seconds; each a bound on one wait, `serve`'s) -------------------------------------------------
Lease = Annotated[
    float,
    option(
        TIMEOUTS,
        "Seconds a peer may stay silent before it is declared dead; heartbeats go every lease/4 on every "
        "connection. The same on both nodes. At least 2 (a bulk push may pause up to 1 s for urgent traffic).",
        min=2.0,
        callback=_finite,
    ),
]
HandshakeTimeout = Annotated[
    float,
    option(
        TIMEOUTS,
        "Seconds a connection may take to connect and authenticate (the decode node's connect and handshake with a "
        "prefill node; the prefill node closes a connection not authenticated by then).",
        min=0.1,
        callback=_finite,
    ),
]
ConfirmTimeout = Annotated[
    float,
    option(
        TIMEOUTS,
        "One-sided lanes (mooncake, nixl, rdma): seconds the peer has to answer LANE_INFO and to confirm that it "
        "accepts or revokes a request's writes; past it the link is declared broken.",
        min=0.1,
        callback=_finite,
    ),
]
WriteTimeout = Annotated[
    float,
    option(
        TIMEOUTS,
        "One-sided lanes (nixl, rdma): seconds one list of KV writes may take to complete; past it the link is "
        "declared broken and the requests that needed it fail (or are recomputed).",
        min=0.1,
        callback=_finite,
    ),
]
FirstTokenTimeout = Annotated[
    float,
    option(
        TIMEOUTS,
        "Decode node: seconds a request waiting for its first token (under full transfer, for its last block; to join "
        "a running batch, for its layers 0-1; prefilled again elsewhere, for the new node) may go with nothing "
        "arriving for it, nor for the requests ahead of it on its link, before it fails. A transfer that keeps "
        "arriving never fails for its length.",
        min=0.1,
        callback=_finite,
    ),
]
QueueTimeout = Annotated[
    float,
    option(
        TIMEOUTS,
        "Decode node: seconds a request may wait for a free pool slot; past it, 503 with the reason.",
        min=0.1,
        callback=_finite,
    ),
]
FetchTimeout = Annotated[
    float,
    option(
        TIMEOUTS,
        "Decode node: seconds one request may wait for an on-demand fetch before it fails (the rest of the batch "
        "goes on).",
        min=0.1,
        callback=_finite,
    ),
]
FetchStallMs = Annotated[
    float,
    option(
        TIMEOUTS,
        "Decode node: a decode step waits this many ms for one request's fetch, then goes on without it: that "
        "request leaves the batch (its step is redone) until the fetch lands, so a stalled prefill node never holds "
        "up requests that do not need it. 0 = wait up to --fetch-timeout.",
        min=0.0,
        callback=_finite,
    ),
]
StepShare = Annotated[
    bool,
    option(
        TIMEOUTS,
        "Decode node, a batch of B: a step waits for one request's fetches, over the whole step, at most that "
        "request's share of it (the last step's own time / B; a wait shared by several requests counts a part to "
        "each); past it the request is held back: it stays in the batch, its step is redone in the next one while "
        "its fetches land, so a request whose KV is still arriving (one that just joined) never holds up the "
        "others for long. Alone, a request is never held back. --no-step-share waits up to --fetch-stall-ms.",
    ),
]
FlushTimeout = Annotated[
    float,
    option(
        TIMEOUTS,
        "Prefill node: seconds a proactive-only request's proactive set may take to land before its first token "
        "goes out; past it the request fails.",
        min=0.1,
        callback=_finite,
    ),
]

# -- Secret and TLS (between the nodes) ---------------------------------------------------------------------
Secret = Annotated[
    str,
    option(
        SECURITY,
        "Shared secret both nodes must hold (or $SMARTGEN_SECRET); required unless --insecure or --role both.",
        envvar="SMARTGEN_SECRET",
    ),
]
Insecure = Annotated[
    bool,
    typer.Option(
        "--insecure",
        help="Run without a shared secret: any peer that can reach the port is accepted. Loopback trials only.",
        rich_help_panel=SECURITY,
    ),
]
TlsCert = Annotated[
    Path | None,
    option(
        SECURITY,
        "TLS on the node-to-node TCP connections: this node's certificate (PEM). A prefill node needs it (with "
        "--tls-key) to serve TLS; a decode node only for mutual TLS.",
    ),
]
TlsKey = Annotated[Path | None, option(SECURITY, "The private key of --tls-cert (PEM).")]
TlsCa = Annotated[
    Path | None,
    option(
        SECURITY,
        "CA certificate (PEM) the peer's certificate must chain to: a decode node verifies its prefill nodes with "
        "it (and turns TLS on); a prefill node given one requires decode nodes to present certificates.",
    ),
]
