"""Tests `smartgen generate` through CliRunner against a real uvicorn server backed by the fake decode service."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from conftest import serve_in_thread
from test_http_api import REPLY, FakeService, FakeTokenizer
from typer.testing import CliRunner

from smartgen.cli.app import app
from smartgen.cli.generate import stream_generate
from smartgen.roles.http_api import create_app
from smartgen.roles.service import ServiceError

runner = CliRunner()


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[FakeService, str]]:
    service = FakeService()
    with serve_in_thread(create_app(service)) as url:
        yield service, url


@pytest.fixture
def live(server: tuple[FakeService, str]) -> tuple[FakeService, str]:
    server[0].reset()
    return server


def test_generate_streams_answer_and_timings(live: tuple[FakeService, str]) -> None:
    service, url = live
    result = runner.invoke(app, ["generate", "Hi", "--url", url, "--max-tokens", "10", "--scheme", "full"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "Hello, world!\n"  # only the answer on stdout
    line = result.stderr.strip()
    assert (
        line.startswith("TTFT ") and " ms  TTST " in line and "mean TBT" in line and "(5 tokens, scheme full)" in line
    )
    prompt_ids, params = service.submitted[0]
    assert prompt_ids == FakeTokenizer().encode("Hi") and params.max_tokens == 10 and params.scheme == "full"


def test_generate_chat(live: tuple[FakeService, str]) -> None:
    service, url = live
    result = runner.invoke(app, ["generate", "Hi", "--url", f"{url}/v1/", "--chat", "--temperature", "0.7"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "Hello, world!\n"
    prompt_ids, params = service.submitted[0]
    assert prompt_ids == FakeTokenizer().encode("<user>Hi<assistant>") and params.temperature == 0.7


def test_stream_generate_yields_pieces_then_usage(live: tuple[FakeService, str]) -> None:
    _, url = live
    *pieces, usage = stream_generate(url, "Hi")
    assert pieces == REPLY
    assert usage["completion_tokens"] == 5 and usage["ttft"] > 0


def test_unreachable_url_is_one_line_error() -> None:
    with socket.socket() as sock:  # bound but not listening: refused, and no other test can take the port meanwhile
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        result = runner.invoke(app, ["generate", "Hi", "--url", url])
    assert result.exit_code != 0
    assert result.stdout == ""
    assert result.stderr.startswith(f"error: cannot reach the decode node at {url}: ")
    assert result.stderr.strip().count("\n") == 0


def test_http_error_shows_server_message(live: tuple[FakeService, str]) -> None:
    service, url = live
    service.refuse = ServiceError("the queue is full (64 waiting)", 429)
    result = runner.invoke(app, ["generate", "Hi", "--url", url])
    assert result.exit_code == 1
    assert result.stderr.strip() == "error: the decode node answered HTTP 429: the queue is full (64 waiting)"


def test_error_mid_stream(live: tuple[FakeService, str]) -> None:
    service, url = live
    service.fail_after = 2
    result = runner.invoke(app, ["generate", "Hi", "--url", url])
    assert result.exit_code == 1
    assert result.stdout == "Hello,\n"
    assert result.stderr.strip() == "error: generation failed: the GPU caught fire"
