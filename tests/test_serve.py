"""Two real processes on loopback: a prefill node and a decode node serving the OpenAI API."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import httpx
import pytest
import torch
from tiny_models import save_tiny_model

from smartgen.policy import get_policy
from smartgen.runtime.models import load_model
from smartgen.runtime.pipeline import InprocPipeline

SECRET = "test-secret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


class Nodes:
    def __init__(self, model_dir, secret: str = SECRET, decode_secret: str | None = None, decode_model=None) -> None:
        self.prefill_port, self.status_port, self.http_port = _free_port(), _free_port(), _free_port()
        common = ["--blocks", "16", "--link-gbps", "1"]
        env = {**os.environ, "SMARTGEN_DB": str(model_dir.parent / "none.db")}
        self.prefill = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "smartgen",
                "serve",
                "--role",
                "prefill",
                "--model",
                str(model_dir),
                "--listen",
                f"127.0.0.1:{self.prefill_port}",
                "--status",
                f"127.0.0.1:{self.status_port}",
                "--secret",
                secret,
                *common,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        _wait(lambda: _get(self.status_url), 60, "the prefill node")
        self.decode = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "smartgen",
                "serve",
                "--role",
                "decode",
                "--model",
                str(decode_model or model_dir),
                "--prefill",
                f"127.0.0.1:{self.prefill_port}",
                "--http",
                f"127.0.0.1:{self.http_port}",
                "--secret",
                decode_secret or secret,
                "--max-tokens",
                "512",
                *common,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    @property
    def status_url(self) -> str:
        return f"http://127.0.0.1:{self.status_port}/status"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def wait_ready(self) -> None:
        def ready() -> bool:
            if self.decode.poll() is not None:
                raise AssertionError("decode node exited: " + self.decode.stderr.read())
            return _get(self.url + "/health")["ready"]

        _wait(ready, 60, "the decode node")

    def stop(self) -> None:
        for process in (self.decode, self.prefill):
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        for process in (self.decode, self.prefill):
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tinym")


@pytest.fixture(scope="module")
def nodes(model_dir):
    pair = Nodes(model_dir)
    try:
        pair.wait_ready()
        yield pair
    finally:
        pair.stop()


def _prompt_ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_http_tokens_equal_the_in_process_result(nodes, model_dir):
    ids = _prompt_ids(1, 120)
    body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "scheme": "smartgen"}
    served = httpx.post(nodes.url + "/v1/completions", json=body, timeout=60).json()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with InprocPipeline(
        load_model(model_dir), get_policy("smartgen", strategy="streaming"), "quest", {"budget": 0.1}, num_blocks=16
    ) as p:
        [local] = p.generate([ids], 8)
    assert served["choices"][0]["text"] == tokenizer.decode(local.tokens, skip_special_tokens=True)
    usage = served["usage"]
    assert usage["completion_tokens"] == 8 and usage["ttft"] > 0 and usage["ttst"] >= usage["ttft"] and usage["tbt"] > 0


def test_the_prefill_node_frees_a_finished_request(nodes):
    body = {"prompt": _prompt_ids(2, 100), "max_tokens": 6, "ignore_eos": True}
    assert httpx.post(nodes.url + "/v1/completions", json=body, timeout=60).status_code == 200
    _wait(lambda: _get(nodes.status_url)["requests_held"] == 0, 10, "the prefill node to free the request")


def test_a_client_that_disconnects_mid_stream_frees_both_nodes(nodes):
    body = {"prompt": _prompt_ids(3, 100), "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", nodes.url + "/v1/completions", json=body, timeout=60) as response:
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data:")
            if chunks >= 3:
                break
    _wait(lambda: _get(nodes.url + "/health")["running"] == 0, 10, "the decode node to drop the request")
    _wait(lambda: _get(nodes.status_url)["requests_held"] == 0, 10, "the prefill node to free the request")
    assert _get(nodes.url + "/health")["free_slots"] == 8


def test_the_openai_client_works_unchanged(nodes):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=nodes.url + "/v1", api_key="unused")
    completion = client.completions.create(model="tinym", prompt="the quick brown fox", max_tokens=5)
    assert completion.choices[0].finish_reason in ("length", "stop") and completion.usage.completion_tokens >= 1
    pieces = [
        c.choices[0].text
        for c in client.completions.create(model="tinym", prompt="hello", max_tokens=5, stream=True)
        if c.choices
    ]
    assert pieces
    chat = client.chat.completions.create(model="tinym", messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    assert chat.choices[0].message.role == "assistant"


@pytest.mark.parametrize("case", ["wrong secret", "other model"])
def test_the_handshake_refuses_with_the_reason(tmp_path, model_dir, case):
    other = save_tiny_model(tmp_path / "other", seed=1) if case == "other model" else None
    pair = Nodes(model_dir, decode_secret="nope" if case == "wrong secret" else None, decode_model=other)
    try:
        code = pair.decode.wait(60)
        err = pair.decode.stderr.read()
        assert code != 0
        assert ("wrong shared secret" if case == "wrong secret" else "model mismatch") in err
        assert "Traceback" not in err
    finally:
        pair.stop()


def test_sigterm_stops_a_node_within_seconds_and_fails_in_flight_requests(model_dir):
    pair = Nodes(model_dir)
    try:
        pair.wait_ready()
        body = {"prompt": _prompt_ids(4, 60), "max_tokens": 450, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", pair.url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    events.append(line)
                    if len(events) == 3:
                        started = time.monotonic()
                        pair.decode.send_signal(signal.SIGTERM)
        assert "shutting down" in " ".join(events[-2:])
        pair.decode.wait(10)
        assert time.monotonic() - started < 10
        pair.prefill.send_signal(signal.SIGINT)
        pair.prefill.wait(10)
    finally:
        pair.stop()
