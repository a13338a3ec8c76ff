"""Aborts free the KV on both nodes: a client that goes away (stream or not) and a first-token timeout.

The KV held is counted on both nodes (the decode node's free slots, the prefill node's requests
held); the time it takes is printed (run with -s) and checked against a generous bound.
"""

import signal
import time

import httpx
import pytest
import torch
from conftest import Nodes, get_json, wait_until
from tiny_models import save_tiny_model

FREE_BOUND_S = 5.0  # the target is 1 s; this is a shared 2-core machine
SLOTS = 8


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    model_dir = save_tiny_model(tmp_path_factory.mktemp("tiny") / "tinym")
    pair = Nodes(model_dir, tmp_path_factory.mktemp("abort"), decode_extra=("--first-token-timeout", "1.5"))
    try:
        pair.wait_ready()
        yield pair
    finally:
        pair.prefill.send_signal(signal.SIGCONT)
        pair.stop()


def _prompt(seed: int) -> list[int]:
    return torch.randint(3, 90, (80,), generator=torch.Generator().manual_seed(seed)).tolist()


def _kv_held(pair: Nodes) -> tuple[int, int]:
    """(slots used on the decode node, requests held on the prefill node)."""
    health = httpx.get(pair.url + "/health", timeout=5).json()
    return SLOTS - health["free_slots"], get_json(pair.status_url)["requests_held"]


def _time_to_free(pair: Nodes) -> float:
    started = time.monotonic()
    wait_until(lambda: _kv_held(pair) == (0, 0), FREE_BOUND_S, "both nodes to free the KV", interval=0.02)
    return time.monotonic() - started


def test_a_client_gone_mid_stream_frees_both_nodes(nodes):
    body = {"prompt": _prompt(1), "max_tokens": 400, "ignore_eos": True, "stream": True, "scheme": "partial"}
    with httpx.stream("POST", nodes.url + "/v1/completions", json=body, timeout=60) as response:
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data:")
            if chunks >= 3:
                assert _kv_held(nodes) == (1, 1)
                break
    print(f"\nstream client gone: both nodes free after {_time_to_free(nodes):.3f} s")


def test_a_client_gone_without_streaming_frees_both_nodes(nodes):
    body = {"prompt": _prompt(2), "max_tokens": 400, "ignore_eos": True, "scheme": "partial"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(nodes.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
    print(f"\nnon-stream client gone: both nodes free after {_time_to_free(nodes):.3f} s")


def test_a_first_token_timeout_fails_the_request_and_frees_both_nodes(nodes):
    nodes.prefill.send_signal(signal.SIGSTOP)  # the prefill node never answers, for less than a lease
    try:
        started = time.monotonic()
        answer = httpx.post(nodes.url + "/v1/completions", json={"prompt": _prompt(3), "max_tokens": 4}, timeout=60)
        failed_after = time.monotonic() - started
    finally:
        nodes.prefill.send_signal(signal.SIGCONT)
    message = answer.json()["error"]["message"]
    stalled = message.startswith("no first token: nothing arrived for it for") and "(bound 1.5 s)" in message
    assert stalled or "lease expired" in message, message
    # a bound passed against a live prefill node is a gateway timeout; a lost one is unavailable (never our 500)
    assert answer.status_code == (504 if "no first token" in message else 503), (answer.status_code, message)
    print(f"\nfirst-token timeout: failed after {failed_after:.2f} s; both free {_time_to_free(nodes):.3f} s later")
    wait_until(lambda: httpx.get(nodes.url + "/health", timeout=5).json()["ready"], 15, "the node to be ready")
