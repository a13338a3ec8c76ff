"""Bad HTTP input against a real decode node: every one is a 4xx JSON error and changes nothing on either node."""

import json
import socket

import httpx
import pytest
from conftest import Nodes, get_json
from tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    model_dir = save_tiny_model(tmp_path_factory.mktemp("tiny") / "tinym")
    pair = Nodes(model_dir, tmp_path_factory.mktemp("input"), decode_extra=("--max-body-bytes", "65536"))
    try:
        pair.wait_ready()
        pair.vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        yield pair
    finally:
        pair.stop()


def _state(pair: Nodes) -> tuple:
    health = httpx.get(pair.url + "/health", timeout=5).json()
    status = get_json(pair.status_url)
    return health["free_slots"], health["running"], health["waiting"], status["requests_held"], status["prefilled"]


CASES = [
    ({"prompt": ""}, 400, "the prompt is empty"),
    ({"prompt": []}, 400, "the prompt is empty"),
    ({"prompt": [[]]}, 400, "the prompt is empty"),
    ({"prompt": [""]}, 400, "the prompt is empty"),
    ({"prompt": ["VOCAB"]}, 400, "outside the vocabulary"),
    ({"prompt": [2**70]}, 400, "outside the vocabulary"),
    ({"prompt": [-1]}, 400, "prompt"),
    ({"prompt": [5, 6], "stop_token_ids": [10**9]}, 400, "stop_token_ids: token id"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": "0"}, 400, "temperature"),
    ({"prompt": "hi", "ignore_eos": 1}, 400, "ignore_eos"),
    ({"prompt": [5] * 600, "max_tokens": 4}, 413, "context of 512 tokens"),
    ({"prompt": "hi", "max_tokens": 100000}, 413, "context of 512 tokens"),
    ({"prompt": "x" * 70000}, 413, "over the 65536-byte limit"),
    ({"messages": []}, 400, "messages"),
    ({"prompt": [5, 6], "scheme": "smartgen[optimal]"}, 400, "future selections"),
    ({"prompt": [5, 6], "scheme": "smartgen[optimal]", "proactive_counts": [[1, 2]]}, 400, "proactive_counts must be"),
    ({"prompt": [5, 6], "scheme": "smartgen[optimal]", "proactive_counts": [[-1, 0]]}, 400, "proactive_counts"),
    ({"prompt": [5, 6], "scheme": "smartgen[optimal]", "proactive_counts": "all"}, 400, "proactive_counts"),
    ({"prompt": [5, 6], "scheme": "full", "proactive_counts": [[0, 0]]}, 400, "for the optimal proactive set"),
    ({"prompt": "hi", "return_selection_counts": "yes"}, 400, "return_selection_counts"),
]


@pytest.mark.parametrize("body,status,message", CASES, ids=[c[2] + f"-{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_a_4xx_json_error_and_changes_nothing(nodes, body, status, message):
    before = _state(nodes)
    if body.get("prompt") == ["VOCAB"]:
        body = {"prompt": [nodes.vocab]}
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    answer = httpx.post(nodes.url + route, json=body, timeout=30)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert message in error["message"] and error["code"] == status
    assert _state(nodes) == before


def test_an_oversized_body_is_refused_from_its_content_length_before_it_is_sent(nodes):
    host, port = nodes.http_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall((head + "Content-Length: 5000000\r\n\r\n").encode())  # and not one byte of the body
        reply = ""
        while "limit" not in reply and (data := sock.recv(65536)):  # head and body may come apart
            reply += data.decode()
    assert reply.startswith("HTTP/1.1 413") and "5000000 bytes is over the 65536-byte limit" in reply


def test_a_chunked_body_over_the_limit_is_refused_too(nodes):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"x" * 4096
        yield b'"}'

    answer = httpx.post(nodes.url + "/v1/completions", content=chunks(), timeout=30)
    assert answer.status_code == 413 and "limit" in answer.json()["error"]["message"]


def test_invalid_json_is_400(nodes):
    headers = {"content-type": "application/json"}
    answer = httpx.post(nodes.url + "/v1/completions", content=b"{nope", headers=headers, timeout=30)
    assert answer.status_code == 400 and "not valid JSON" in answer.json()["error"]["message"]
