"""Tests the decode node's OpenAI-compatible HTTP API against a fake DecodeService, served by uvicorn on loopback."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import serve_in_thread

from smartgen.roles.http_api import create_app
from smartgen.roles.service import FinishEvent, GenerationParams, RequestHandle, ServiceError, TokenEvent

REPLY = ["Hello", ",", " wor", "ld", "!"]


class FakeTokenizer:
    """One token per character; the chat template tags each message with its role."""

    chat_template = "<role>content ... <assistant>"

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = False, tokenize: bool = False
    ) -> Any:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" * add_generation_prompt)
        return {"input_ids": self.encode(text)} if tokenize else text  # a dict, as transformers 5's BatchEncoding


class PlainTokenizer(FakeTokenizer):
    chat_template = None


class FakeService:
    """A DecodeService whose requests are answered by a thread emitting `pieces`, `delay` seconds apart."""

    model_name = "fake-model"

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.tokenizer: FakeTokenizer = FakeTokenizer()
        self.pieces, self.delay = list(REPLY), 0.0
        self.refuse: ServiceError | None = None
        self.fail_after: int | None = None  # emit FinishEvent(*failure) after this many tokens
        self.failure = ("error", "the GPU caught fire")  # (reason, error)
        self.ready = True
        self.submitted: list[tuple[list[int], GenerationParams]] = []
        self.handles: list[RequestHandle] = []

    def health(self) -> dict[str, Any]:
        return {"ready": self.ready, "prefill_nodes": 1, "running": 0, "waiting": 0}

    def submit(self, prompt_ids: list[int], params: GenerationParams) -> RequestHandle:
        if self.refuse is not None:
            raise self.refuse
        handle = RequestHandle(f"req{len(self.handles)}", len(prompt_ids))
        self.submitted.append((prompt_ids, params))
        self.handles.append(handle)
        args = (handle, params, list(self.pieces), self.delay, self.fail_after, self.failure)
        threading.Thread(target=self._run, args=args, daemon=True).start()
        return handle

    @staticmethod
    def _run(
        handle: RequestHandle,
        params: GenerationParams,
        pieces: list[str],
        delay: float,
        fail_after: int | None,
        failure: tuple[str, str],
    ) -> None:
        times: list[float] = []

        def usage() -> dict[str, Any]:
            n = len(times)
            return {
                "prompt_tokens": handle.prompt_tokens,
                "completion_tokens": n,
                "total_tokens": handle.prompt_tokens + n,
                "ttft": times[0] - handle.created if n else None,
                "ttst": times[1] - handle.created if n > 1 else None,
                "tbt": (times[-1] - times[1]) / (n - 2) if n > 2 else None,
                "scheme": params.scheme or "smartgen",
            }

        for index, text in enumerate(pieces[: params.max_tokens]):
            if index == fail_after:
                return handle.put(FinishEvent(*failure, usage()))
            deadline = time.monotonic() + delay
            while time.monotonic() < deadline and not handle.cancelled:
                time.sleep(0.005)
            if handle.cancelled:
                return handle.put(FinishEvent("aborted", None, usage()))
            times.append(time.monotonic())
            handle.put(TokenEvent(1000 + index, text, index, times[-1]))
        handle.put(FinishEvent("length" if len(pieces) > params.max_tokens else "stop", None, usage()))


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[FakeService, str]]:
    service = FakeService()
    with serve_in_thread(create_app(service)) as url:
        yield service, url


@pytest.fixture
def live(server: tuple[FakeService, str]) -> tuple[FakeService, str]:
    server[0].reset()
    return server


def sse_events(text: str) -> list[Any]:
    """Parses a whole SSE body, checking OpenAI's framing: every event is one `data: ...` line then a blank line."""
    assert text.endswith("data: [DONE]\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: ") and "\n" not in block, block
        events.append(block[6:] if block == "data: [DONE]" else json.loads(block[6:]))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=10)


def assert_usage(usage: dict[str, Any], prompt_tokens: int, completion_tokens: int, scheme: str) -> None:
    assert usage["prompt_tokens"] == prompt_tokens and usage["completion_tokens"] == completion_tokens
    assert usage["total_tokens"] == prompt_tokens + completion_tokens
    assert usage["scheme"] == scheme
    assert 0 <= usage["ttft"] <= usage["ttst"] and usage["tbt"] >= 0


# -- plain endpoints --


def test_models_and_health(live: tuple[FakeService, str]) -> None:
    service, url = live
    models = httpx.get(f"{url}/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["fake-model"]
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and health.json()["ready"] is True
    service.ready = False
    assert httpx.get(f"{url}/health").status_code == 503


# -- completions --


def test_completion(live: tuple[FakeService, str]) -> None:
    service, url = live
    body = {
        "model": "fake-model",
        "prompt": "Hi",
        "max_tokens": 10,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 7,
        "scheme": "full",
        "ignore_eos": True,
    }
    response = post(url, "/v1/completions", body)
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["id"].startswith("cmpl-") and out["object"] == "text_completion" and out["model"] == "fake-model"
    assert isinstance(out["created"], int)
    assert out["choices"] == [{"index": 0, "text": "Hello, world!", "finish_reason": "stop", "logprobs": None}]
    assert_usage(out["usage"], 2, 5, "full")
    prompt_ids, params = service.submitted[0]
    assert prompt_ids == [ord("H"), ord("i")]
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (10, 0.5, 0.9, 7)
    assert params.ignore_eos and params.scheme == "full"


def test_completion_token_ids_and_length(live: tuple[FakeService, str]) -> None:
    service, url = live
    out = post(url, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2}).json()
    assert out["choices"][0]["text"] == "Hello," and out["choices"][0]["finish_reason"] == "length"
    assert service.submitted[0][0] == [5, 6, 7]
    assert out["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("include_usage", [False, True])
def test_completion_stream(live: tuple[FakeService, str], include_usage: bool) -> None:
    _, url = live
    body: dict[str, Any] = {"prompt": "Hi", "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    response = post(url, "/v1/completions", body)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    usage = events.pop() if include_usage else None
    assert [e["choices"][0]["text"] for e in events] == [*REPLY, ""]
    assert [e["choices"][0]["finish_reason"] for e in events] == [None] * len(REPLY) + ["stop"]
    assert {e["object"] for e in events} == {"text_completion"} and len({e["id"] for e in events}) == 1
    assert all(e["id"].startswith("cmpl-") and e["model"] == "fake-model" for e in events)
    if include_usage:
        assert all(e["usage"] is None for e in events)
        assert usage["choices"] == [] and usage["id"] == events[0]["id"]
        assert_usage(usage["usage"], 2, 5, "smartgen")
    else:
        assert all("usage" not in e for e in events)


# -- chat --


def test_chat(live: tuple[FakeService, str]) -> None:
    service, url = live
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    out = post(url, "/v1/chat/completions", {"messages": messages, "max_completion_tokens": 3}).json()
    assert out["id"].startswith("chatcmpl-") and out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "Hello, wor"}
    assert out["choices"][0]["finish_reason"] == "length"
    assert service.submitted[0][0] == FakeTokenizer().encode("<system>Be brief.<user>Hi<assistant>")


def test_chat_stream(live: tuple[FakeService, str]) -> None:
    _, url = live
    body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(post(url, "/v1/chat/completions", body).text)
    usage = events.pop()
    assert {e["object"] for e in events} == {"chat.completion.chunk"} and events[0]["id"].startswith("chatcmpl-")
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0]["role"] == "assistant" and deltas[-1] == {}
    assert [d["content"] for d in deltas[1:-1]] == REPLY
    assert [e["choices"][0]["finish_reason"] for e in events][-2:] == [None, "stop"]
    assert_usage(usage["usage"], len("<user>Hi<assistant>"), 5, "smartgen")


# -- the real openai client --


def test_openai_client(live: tuple[FakeService, str]) -> None:
    _, url = live
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list()] == ["fake-model"]

    completion = client.completions.create(model="fake-model", prompt="Hi", max_tokens=8, extra_body={"scheme": "full"})
    assert completion.choices[0].text == "Hello, world!" and completion.choices[0].finish_reason == "stop"
    assert completion.usage.completion_tokens == 5 and completion.usage.model_extra["scheme"] == "full"
    assert completion.usage.model_extra["ttft"] > 0

    chunks = list(
        client.completions.create(model="fake-model", prompt="Hi", stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello, world!"
    assert chunks[-1].usage.total_tokens == 7 and chunks[-1].usage.model_extra["ttst"] > 0

    chat = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}])
    assert chat.choices[0].message.content == "Hello, world!" and chat.choices[0].message.role == "assistant"

    stream = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "Hi"}], stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello, world!"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_openai_client_sees_errors(live: tuple[FakeService, str]) -> None:
    service, url = live
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.completions.create(model="fake-model", prompt="Hi", n=2)
    service.refuse = ServiceError("the queue is full (64 waiting)", 429)
    with pytest.raises(openai.RateLimitError, match="queue is full"):
        client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}])


# -- errors --


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": "Hi", "n": 2}, "n must be 1"),
        ({"prompt": "Hi", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "Hi", "temperature": -1}, "temperature"),
        ({"prompt": 5}, "prompt: must be a string or a list of token ids"),
        ({"prompt": [1, -2]}, "prompt: must be a string or a list of token ids"),
        ({"messages": [{"content": "Hi"}]}, "messages.0.role: Field required"),
        ({"max_tokens": 3}, "prompt: Field required"),
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": "Hi", "echo": True}, "echo"),
        ({"prompt": ["a", "b"]}, "batched prompts"),
    ],
)
def test_bad_requests_are_400(live: tuple[FakeService, str], body: dict[str, Any], message: str) -> None:
    _, url = live
    response = post(url, "/v1/chat/completions" if "messages" in body else "/v1/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error" and error["code"] == 400


def test_invalid_json_and_unknown_model(live: tuple[FakeService, str]) -> None:
    _, url = live
    response = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    response = post(url, "/v1/completions", {"model": "gpt-4", "prompt": "Hi"})
    assert response.status_code == 404 and "fake-model" in response.json()["error"]["message"]
    response = httpx.get(f"{url}/v1/nothing")
    assert response.status_code == 404 and "error" in response.json()


def test_refusal_status_passes_through(live: tuple[FakeService, str]) -> None:
    service, url = live
    service.refuse = ServiceError("the queue is full", 429)
    response = post(url, "/v1/completions", {"prompt": "Hi", "stream": True})
    assert response.status_code == 429 and response.json()["error"]["message"] == "the queue is full"
    service.refuse = ServiceError("prompt of 9000 tokens is longer than 8192", 413)
    assert post(url, "/v1/completions", {"prompt": "Hi"}).status_code == 413


def test_chat_without_template_is_400(live: tuple[FakeService, str]) -> None:
    service, url = live
    service.tokenizer = PlainTokenizer()
    response = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
    assert response.status_code == 400 and "no chat template" in response.json()["error"]["message"]
    assert not service.submitted


def test_generation_error(live: tuple[FakeService, str]) -> None:
    service, url = live
    service.fail_after = 2
    response = post(url, "/v1/completions", {"prompt": "Hi"})
    assert response.status_code == 500 and "GPU caught fire" in response.json()["error"]["message"]
    events = sse_events(post(url, "/v1/completions", {"prompt": "Hi", "stream": True}).text)
    assert [e["choices"][0]["text"] for e in events[:-1]] == REPLY[:2]
    assert "GPU caught fire" in events[-1]["error"]["message"] and events[-1]["error"]["code"] == 500


@pytest.mark.parametrize(
    "kind, reason, status, type_",
    [
        (
            "unavailable",
            "prefill node connection lost: peer silent for 3.0 s: lease expired",
            503,
            "service_unavailable",
        ),
        ("unavailable", "the decode node is shutting down", 503, "service_unavailable"),
        ("timeout", "its KV did not arrive within 120 s", 504, "gateway_timeout"),
    ],
)
def test_a_lost_prefill_node_a_stopping_node_and_a_timeout_are_the_client_s_to_retry(
    live: tuple[FakeService, str], kind: str, reason: str, status: int, type_: str
) -> None:
    """Not our bug, so not 500: a prefill node lost (or none live) or the decode node stopping is 503; KV that did
    not arrive within its bound from a prefill node still alive is 504."""
    service, url = live
    service.fail_after, service.failure = 2, (kind, reason)
    response = post(url, "/v1/completions", {"prompt": "Hi"})
    assert response.status_code == status
    assert response.json()["error"] == {"message": reason, "type": type_, "code": status}
    events = sse_events(post(url, "/v1/completions", {"prompt": "Hi", "stream": True}).text)
    assert [e["choices"][0]["text"] for e in events[:-1]] == REPLY[:2]
    assert events[-1]["error"] == {"message": reason, "type": type_, "code": status}


# -- stop strings --


@pytest.mark.parametrize(
    ("stop", "text", "reason"),
    [
        (" world", "Hello,", "stop"),  # spans two tokens
        (["xyz", "lo, w"], "Hel", "stop"),  # starts inside a token; the first of several that matches
        ("!", "Hello, world", "stop"),
        ("!!", "Hello, world!", "stop"),  # a held-back prefix that never completes is released at the end
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(live: tuple[FakeService, str], stop: Any, text: str, reason: str, stream: bool) -> None:
    service, url = live
    response = post(
        url,
        "/v1/completions",
        {"prompt": "Hi", "stop": stop, "stream": stream, "stream_options": {"include_usage": True} if stream else None},
    )
    if stream:
        events = sse_events(response.text)
        usage = events.pop()["usage"]
        assert "".join(e["choices"][0]["text"] for e in events) == text
        assert events[-1]["choices"][0]["finish_reason"] == reason
    else:
        out = response.json()
        usage = out["usage"]
        assert (out["choices"][0]["text"], out["choices"][0]["finish_reason"]) == (text, reason)
    matched = text != "Hello, world!"
    assert service.handles[0].cancelled == matched  # a matched stop string ends generation in the service
    assert usage["completion_tokens"] <= 5


# -- a client that goes away --


def wait_for(predicate: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_disconnect_mid_stream_cancels(live: tuple[FakeService, str]) -> None:
    service, url = live
    service.pieces, service.delay = ["tok "] * 200, 0.05
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", f"{url}/v1/completions", json={"prompt": "Hi", "stream": True}) as response:
            chunks: list[str] = []
            for line in response.iter_lines():
                if line.startswith("data:"):
                    chunks.append(line)
                if len(chunks) == 2:
                    break
    assert wait_for(lambda: service.handles[0].cancelled), "the service never saw the cancel"
    assert service.handles[0].cancel_reason == "client went away"


def test_disconnect_without_stream_cancels(live: tuple[FakeService, str]) -> None:
    service, url = live
    service.pieces, service.delay = ["tok "] * 200, 0.05
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={"prompt": "Hi"}, timeout=0.3)
    assert wait_for(lambda: service.handles[0].cancelled), "the service never saw the cancel"


def test_an_asyncio_consumer_is_woken_by_each_event_not_by_polling() -> None:
    """Events put from the scheduler's thread reach an asyncio reader at once: with the fallback wake an hour away,
    every event and the finish still arrive (a lost wake-up would hang here until the 10 s guard)."""
    import asyncio

    handle = RequestHandle("r", 3)

    def produce() -> None:
        for i in range(5):
            time.sleep(0.01)
            handle.put(TokenEvent(i, str(i), i, time.monotonic()))
        handle.put(FinishEvent("length", None, {}))

    async def consume() -> list[Any]:
        got = []
        threading.Thread(target=produce, daemon=True).start()
        async for event in handle.aevents(fallback_s=3600):
            got.append(event)
        return got

    events = asyncio.run(asyncio.wait_for(consume(), 10))
    assert [e.index for e in events[:-1]] == [0, 1, 2, 3, 4]
    assert isinstance(events[-1], FinishEvent)
    assert handle._wake is None  # the consumer unhooked itself: a later put wakes no closed loop
    handle.put(FinishEvent("length", None, {}))  # ignored (finished), and no error from a dead loop
