"""Two real processes on loopback: a prefill node and a decode node serving the OpenAI API."""

import json
import signal
import subprocess
import sys

import httpx
import pytest
import torch
from conftest import Nodes, get_json, pipeline_text, wait_until
from tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tinym")


@pytest.fixture(scope="module")
def nodes(model_dir, tmp_path_factory):
    pair = Nodes(model_dir, tmp_path_factory.mktemp("nodes"))
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
    assert served["choices"][0]["text"] == pipeline_text(model_dir, ids, 8)
    usage = served["usage"]
    assert usage["completion_tokens"] == 8 and usage["ttft"] > 0 and usage["ttst"] >= usage["ttft"] and usage["tbt"] > 0


def _stream_pieces(url: str, body: dict) -> list[str]:
    pieces = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                pieces += [c["text"] for c in json.loads(line[5:])["choices"] if c["finish_reason"] is None]
    return pieces


def test_every_token_streams_a_chunk_and_special_tokens_show_when_asked(nodes, model_dir):
    """Each token is a chunk, as vLLM streams them: one that adds no text (</s>, second here with ignore_eos) comes
    empty, so a client times it; `skip_special_tokens` false (vLLM's parameter) shows it as text."""
    ids = _prompt_ids(1, 100)
    body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "scheme": "smartgen"}
    shown = _stream_pieces(nodes.url, {**body, "skip_special_tokens": False})
    assert "".join(shown) == pipeline_text(model_dir, ids, 8, skip_special_tokens=False)
    assert len(shown) == 8 and shown[1] == "</s>"
    hidden = _stream_pieces(nodes.url, body)
    assert "".join(hidden) == pipeline_text(model_dir, ids, 8)
    assert len(hidden) == 8 and hidden[1] == "" and all(hidden[:1] + hidden[2:])


def test_the_prefill_node_frees_a_finished_request(nodes):
    body = {"prompt": _prompt_ids(2, 100), "max_tokens": 6, "ignore_eos": True}
    assert httpx.post(nodes.url + "/v1/completions", json=body, timeout=60).status_code == 200
    wait_until(lambda: get_json(nodes.status_url)["requests_held"] == 0, 10, "the prefill node to free the request")
    status = get_json(nodes.status_url)
    assert status["crossed_twice_bytes"] >= 0  # KV a fetch resent while a push of it was on the link
    metrics = httpx.get(nodes.status_url.rsplit("/", 1)[0] + "/metrics", timeout=10).text
    assert "smartgen:kv_crossed_twice_bytes_total" in metrics


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="scheduling policies per thread are Linux's")
def test_the_decode_nodes_step_thread_alone_preempts_its_other_threads(nodes):
    """`serve --role decode` batches its process before any thread starts (SCHED_BATCH: a thread that wakes never
    preempts a running one); the step thread alone goes back to the default, so a frame landing on a lane's receiver
    or a fetch worker's wake-up waits for the step to block rather than cut into it (lanes/thread_priority.py)."""
    body = {"prompt": _prompt_ids(3, 64), "max_tokens": 4, "ignore_eos": True, "scheme": "smartgen"}
    assert httpx.post(nodes.url + "/v1/completions", json=body, timeout=60).status_code == 200
    policies = get_json(nodes.url + "/status")["threads_policy"]
    assert policies["decode-scheduler"] == "other"
    assert policies.get("smartgen-fetch", "batch") == "batch"  # started (if at all) by the step thread, yet batched
    lanes = [role for role in policies if role.startswith("decode.")]
    assert lanes and all(policies[role] == "batch" for role in lanes), policies
    assert policies["decode-listen"] == "batch" and policies["MainThread"] == "batch"
    prefill = get_json(nodes.status_url)["threads_policy"]
    assert prefill and "batch" not in prefill.values()  # left as it was: its threads that answer fetches preempt


def test_a_client_that_disconnects_mid_stream_frees_both_nodes(nodes):
    body = {"prompt": _prompt_ids(3, 100), "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", nodes.url + "/v1/completions", json=body, timeout=60) as response:
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data:")
            if chunks >= 3:
                break
    wait_until(lambda: get_json(nodes.url + "/health")["running"] == 0, 10, "the decode node to drop the request")
    wait_until(lambda: get_json(nodes.status_url)["requests_held"] == 0, 10, "the prefill node to free the request")
    assert get_json(nodes.url + "/health")["free_slots"] == 8


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
    pair = Nodes(model_dir, tmp_path, decode_secret="nope" if case == "wrong secret" else None, decode_model=other)
    try:
        code = pair.decode.wait(60)
        err = pair.output("decode")
        assert code != 0
        assert ("wrong shared secret" if case == "wrong secret" else "model mismatch") in err
        assert "Traceback" not in err
    finally:
        pair.stop()


def test_sigterm_stops_a_node_and_fails_in_flight_requests(model_dir, tmp_path):
    pair = Nodes(model_dir, tmp_path)
    try:
        pair.wait_ready()
        body = {"prompt": _prompt_ids(4, 60), "max_tokens": 450, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", pair.url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    events.append(line)
                    if len(events) == 3:
                        pair.decode.send_signal(signal.SIGTERM)
        assert "shutting down" in " ".join(events[-2:])
        assert '"code": 503' in " ".join(events[-2:])  # the client's to retry elsewhere, not our bug
        assert pair.decode.wait(60) == 0  # a hang guard, not a timing claim; the node stops cleanly
        pair.prefill.send_signal(signal.SIGINT)
        assert pair.prefill.wait(60) == 0
    finally:
        pair.stop()


def test_the_nodes_serve_over_every_lane_the_machine_has(model_dir, tmp_path, socket_lane_kind):
    pair = Nodes(model_dir, tmp_path, extra=("--blocks", "16", "--link-gbps", "1", "--lane", socket_lane_kind))
    try:
        pair.wait_ready()
        ids = _prompt_ids(9, 90)
        body = {"prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "scheme": "smartgen"}
        served = httpx.post(pair.url + "/v1/completions", json=body, timeout=120).json()
        assert served["usage"]["completion_tokens"] == 6, served
        wait_until(lambda: get_json(pair.status_url)["requests_held"] == 0, 30, "the prefill node to free it")
    finally:
        pair.stop()


def test_nodes_on_different_lanes_refuse_each_other_with_the_reason(model_dir, tmp_path):
    pair = Nodes(model_dir, tmp_path, extra=("--blocks", "16", "--lane", "tcp"))
    try:
        assert pair.decode is not None
        pair.decode.kill()
        pair.decode.wait()
        decode = subprocess.run(
            [sys.executable, "-m", "smartgen", "serve", "--role", "decode", "--model", str(model_dir)]
            + ["--prefill", pair.prefill_address, "--http", "127.0.0.1:0", "--secret", "test-secret"]
            + ["--blocks", "16", "--lane", "nixl"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if "cannot run here" in decode.stderr:
            pytest.skip(decode.stderr.strip())
        assert decode.returncode != 0 and "lane mismatch" in decode.stderr and "Traceback" not in decode.stderr
    finally:
        pair.stop()
