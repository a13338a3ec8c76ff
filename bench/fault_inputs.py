"""bench/faults.py's bad inputs: HTTP bodies, hostile or broken peers on the prefill port, serving without a secret."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Any

import httpx
from fault_nodes import SECRET, Fault, Trial, complete, health, held

from smartgen.apps.bench.models import SAMPLE_MODEL
from smartgen.apps.cluster import LocalCluster
from smartgen.lanes.auth import client_handshake
from smartgen.lanes.wire import HEADER, MAGIC, PROTOCOL_VERSION, FrameType, HandshakeError, recv_header

# -- bad input over HTTP: a 4xx with the reason, nothing changed on either node ------------------------------
HTTP_INPUTS: dict[str, tuple[dict[str, Any] | bytes, int]] = {
    'empty prompt ""': ({"prompt": "", "max_tokens": 4}, 400),
    "empty prompt []": ({"prompt": [], "max_tokens": 4}, 400),
    "token id >= vocabulary": ({"prompt": [5, 1024], "max_tokens": 4}, 400),
    "token id 2^70": ({"prompt": [5, 2**70], "max_tokens": 4}, 400),
    'stream "yes"': ({"prompt": [5, 6], "max_tokens": 4, "stream": "yes"}, 400),
    "max_tokens true": ({"prompt": [5, 6], "max_tokens": True}, 400),
    "over the model's context": ({"prompt": [5] * 16000, "max_tokens": 1000}, 413),
    "5 MB body": (b'{"prompt": "' + b"a" * 5_000_000 + b'"}', 413),
}


def bad_http(name: str) -> Fault:
    body, expected = HTTP_INPUTS[name]

    def trial(cluster: LocalCluster, seed: int) -> Trial:
        started = time.monotonic()
        if isinstance(body, bytes):
            answer = httpx.post(
                cluster.url + "/v1/completions", content=body, timeout=60, headers={"content-type": "application/json"}
            )
        else:
            answer = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60)
        detect = time.monotonic() - started
        message = answer.json().get("error", {}).get("message", "") if answer.content else ""
        untouched = held(cluster) == 0 and health(cluster)["running"] == 0
        ok = answer.status_code == expected and bool(message) and untouched
        return Trial(ok, f"{answer.status_code} '{message[:36]}'", detect, None)

    return trial


# -- hostile or broken peers on the prefill node's port: closed with a reason, the node serves on -----------
def _closed_after(sock: socket.socket, started: float) -> float | None:
    """Seconds from `started` until the listener closes `sock` (frames it sends before are read and ignored)."""
    sock.settimeout(30)
    try:
        while True:
            frame = recv_header(sock)
            if frame.type == FrameType.BYE:
                break
    except (ConnectionError, OSError, ValueError):
        pass
    return time.monotonic() - started


def hostile(kind: str) -> Fault:
    def trial(cluster: LocalCluster, seed: int) -> Trial:
        identity = decode_identity()  # before connecting: loading the model takes longer than a handshake may
        host, port = cluster.prefill_listen[0].rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=30)
        try:
            if kind not in ("wrong secret", "push without control"):  # those answer the CHALLENGE themselves
                assert recv_header(sock).type == FrameType.CHALLENGE
            started = time.monotonic()
            outcome = "closed"
            if kind == "wrong secret":
                try:
                    client_handshake(sock, "not-the-secret", {"channel": "push", "session": "x" * 32})
                    outcome = "ACCEPTED"
                except HandshakeError as exc:
                    outcome = f"REJECT '{str(exc)[-28:]}'"
            elif kind == "16 MiB meta before auth":
                sock.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION, int(FrameType.HELLO), 0, 16 * 2**20, 0))
            elif kind == "meta a JSON array":
                sock.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION, int(FrameType.HELLO), 0, 2, 0) + b"[]")
            elif kind == "silent connection":
                pass  # says nothing: closed at --handshake-timeout
            elif kind == "push without control":  # a real decode node's HELLO, then never the control connection
                client_handshake(sock, SECRET, {**identity, "channel": "push", "session": f"{seed:032x}"})
                started = time.monotonic()
                outcome = "authenticated, then closed unpaired"
            detect = _closed_after(sock, started)
        finally:
            sock.close()
        served = complete(cluster, seed).status_code == 200
        ok = "ACCEPTED" not in outcome and served
        return Trial(ok, f"{outcome}; node served on" if served else f"{outcome}; node did NOT serve", detect, None)

    return trial


_IDENTITY: dict[str, Any] = {}


def decode_identity() -> dict[str, Any]:
    """What a decode node of the sample model says in its HELLO (loads the model once)."""
    if not _IDENTITY:
        from smartgen.roles.identity import node_identity
        from smartgen.runtime.models import kv_layout, load_model

        model = load_model(SAMPLE_MODEL)
        identity = node_identity(model, kv_layout(model, num_blocks=16), SAMPLE_MODEL.name)
        _IDENTITY.update(identity, lane="tcp", pool={"slots": 4, "max_tokens": 1024}, node="faults")
    return _IDENTITY


def empty_secret(cluster: LocalCluster, seed: int) -> Trial:
    env = {k: v for k, v in os.environ.items() if k != "SMARTGEN_SECRET"}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "smartgen", "serve", "--role", "prefill", "--model", str(SAMPLE_MODEL)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    detect = time.monotonic() - started
    ok = done.returncode == 2 and "no shared secret" in done.stderr
    return Trial(ok, f"exit {done.returncode}: refuses to start, names --insecure", detect, None)
