"""SmartGen decode nodes behind SGLang's router in its regular mode, as real processes on 127.0.0.1 (slow).

Two prefill nodes and two decode nodes: decode 1 uses both prefill nodes, decode 2 only the second, so
killing the second prefill node leaves decode 2 up but not ready (/health and requests answer 503) while
decode 1 keeps serving. Three routers stand in front of both decode nodes at once:
- round_robin with health checks too slow to matter here and no circuit breaker: only its retries of our
  503s, and of a refused connection once decode 2 is dead, keep every request served;
- cache_aware and power_of_two with one-second health checks: they mark the not-ready node unhealthy and
  route around it.
The router is installed once into a virtual environment of its own under the cache folder (not into
SmartGen's); the test skips, with pip's reason, where it cannot be installed (no network, no wheel).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Nodes, get_json, wait_until
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import save_tiny_model

from smartgen.apps.router import RouterUnavailable, ensure_router
from smartgen.roles.processes import stop_processes

pytestmark = pytest.mark.slow

MODEL = "tinym"


@pytest.fixture(scope="module")
def router_python() -> Path:
    """A Python with `sglang_router` importable, in a venv of its own (made once, kept in the cache folder)."""
    try:
        return ensure_router(say=lambda line: None)
    except RouterUnavailable as exc:
        pytest.skip(str(exc))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Router:
    """`python -m sglang_router.launch_router` in front of `workers`, its log in `log`."""

    def __init__(
        self, python: Path, workers: list[str], policy: str, health_interval_s: int, log: Path, *extra: str
    ) -> None:
        self.log = log
        options = ["--worker-urls", *workers, "--policy", policy, "--host", "127.0.0.1"]
        # two failed checks in a row mark a node unhealthy: one slow answer on this busy machine is not enough
        options += ["--health-check-interval-secs", str(health_interval_s), "--health-failure-threshold", "2"]
        options += ["--health-success-threshold", "1", "--health-check-timeout-secs", "10", *extra]
        for _ in range(5):  # a port picked free may be taken before the router binds it (other processes' sockets)
            port, metrics_port = _free_port(), _free_port()
            self.url = f"http://127.0.0.1:{port}"
            self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
            ports = ["--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
            with log.open("w") as out:
                command = [str(python), "-m", "sglang_router.launch_router", *options, *ports]
                self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
            if wait_until(self._listening, 60, "the router to listen") == "up":
                return
        raise AssertionError(f"the router found its ports taken five times:\n{self.output()}")

    def _listening(self) -> str | None:
        """Whether the router answers on both its ports ("up") or exited for one taken since it was picked ("taken")."""
        if self.process.poll() is not None:
            if "Address already in use" in self.output():
                return "taken"
            raise AssertionError(f"the router exited ({self.process.returncode}):\n{self.output()}")
        get_json(self.url + "/workers")  # OSError (refused) until it listens: not yet
        self.retries()  # and its Prometheus endpoint
        return "up"

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def workers(self) -> dict[str, dict[str, Any]]:
        """The router's workers by URL (`GET /workers`)."""
        if self.process.poll() is not None:
            raise AssertionError(f"the router exited ({self.process.returncode}):\n{self.output()}")
        listed = get_json(self.url + "/workers")
        return {w["url"].rstrip("/"): w for w in listed.get("workers", [])}

    def retries(self) -> float:
        """Requests the router sent again to another node (its `smg_worker_retries_total`)."""
        return _metric(self.metrics_url, "smg_worker_retries_total")

    def healthy(self, url: str) -> bool:
        worker = self.workers().get(url)
        return bool(worker and worker.get("is_healthy"))


def _start_decode(model_dir: Path, run_dir: Path, name: str, prefill: str) -> subprocess.Popen:
    """A decode node as Nodes starts one (same flags), on the prefill nodes `prefill` ("host:port,...")."""
    with (run_dir / f"{name}.log").open("w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "smartgen", "serve", "--role", "decode", "--model", str(model_dir)]
            + ["--prefill", prefill, "--http", "127.0.0.1:0", "--ready-file", str(run_dir / f"{name}.json")]
            + ["--secret", "test-secret", "--max-tokens", "512", "--blocks", "16", "--link-gbps", "1"]
            + ["--lane", "tcp"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "SMARTGEN_DB": str(run_dir / "none.db")},
        )


def _metric(url: str, name: str) -> float:
    """The sum of `name`'s samples (all labels) at the Prometheus endpoint `url`; 0 before it has any."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def _served(url: str) -> int:
    """Requests the decode node at `url` took (its e2e histogram's count)."""
    return int(_metric(url + "/metrics", "smartgen:e2e_request_latency_seconds_count"))


def _peers_up(url: str) -> int:
    return sum(peer["state"] == "up" for peer in get_json(url + "/health")["peers"])


def _health_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture(scope="module")
def cluster(router_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    model_dir = save_tiny_model(tmp_path_factory.mktemp("tiny") / MODEL)
    run_dir = tmp_path_factory.mktemp("cluster")
    nodes = Nodes(model_dir, run_dir, num_prefills=2)  # decode 1, on both prefill nodes
    decode2: subprocess.Popen | None = None
    routers: list[Router] = []
    try:
        nodes.wait_ready()
        prefill2 = nodes.prefills["prefill2"][1]
        decode2 = _start_decode(model_dir, run_dir, "decode2", prefill2)

        def written() -> bool:
            assert decode2 is not None and decode2.poll() is None, (run_dir / "decode2.log").read_text()
            return (run_dir / "decode2.json").exists()

        wait_until(written, 120, "decode 2's ready file")
        url2 = "http://" + json.loads((run_dir / "decode2.json").read_text())["http"]
        wait_until(lambda: get_json(url2 + "/health")["ready"], 60, "decode 2 to be ready")
        workers = [nodes.url, url2]
        # round robin: no health check in the test's time and no circuit breaker, so only retries route around
        for policy, interval, extra in (
            ("round_robin", 600, ("--disable-circuit-breaker",)),
            ("cache_aware", 1, ()),
            ("power_of_two", 1, ()),
        ):
            routers.append(Router(router_python, workers, policy, interval, run_dir / f"router-{policy}.log", *extra))
        for router in routers:
            wait_until(lambda r=router: all(r.healthy(u) for u in workers), 120, f"{router.url} to take both nodes")
        yield {"nodes": nodes, "decode2": decode2, "url1": nodes.url, "url2": url2, "routers": routers}
    finally:
        for router in routers:
            router.process.terminate()
        stop_processes([r.process for r in routers] + ([decode2] if decode2 is not None else []))
        nodes.stop()


def _client(router: Router) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _complete(router: Router, prompt: str) -> Any:
    completion = _client(router).completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert completion.choices[0].finish_reason in ("length", "stop") and completion.usage.completion_tokens >= 1
    return completion


def test_the_routers_serve_through_both_nodes_then_around_a_not_ready_one_then_a_dead_one(cluster):
    nodes, decode2, url1, url2 = cluster["nodes"], cluster["decode2"], cluster["url1"], cluster["url2"]
    round_robin, *health_checked = cluster["routers"]
    for router in cluster["routers"]:
        # the model the router found: ours, not "unknown", with what /server_info and /model_info say of it
        assert {w.get("model_id") for w in router.workers().values()} == {MODEL}, router.workers()
        for worker in router.workers().values():
            assert worker["metadata"]["model_path"].endswith(MODEL) and worker["metadata"]["model_type"] == "llama"
        client = _client(router)
        assert [m.id for m in client.models.list().data] == [MODEL]
        _complete(router, "the quick brown fox")
        pieces = [
            c.choices[0].text
            for c in client.completions.create(model=MODEL, prompt="hello", max_tokens=4, stream=True)
            if c.choices
        ]
        assert pieces
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert chat.choices[0].message.role == "assistant"
        # SmartGen's own request fields pass through, and its usage comes back whole
        extra = client.completions.create(
            model=MODEL, prompt="hello world", max_tokens=3, extra_body={"scheme": "full"}
        )
        assert extra.model_dump()["usage"]["scheme"] == "full"
        assert get_json(router.url + "/get_model_info")["served_model_name"] == MODEL  # proxied to a node
        # the router read our /get_load: -1 where it could not
        assert all(w["load"] >= 0 for w in get_json(router.url + "/get_loads")["workers"])

    before = (_served(url1), _served(url2))
    for i in range(4):
        _complete(round_robin, f"the pass key is {i}")
    assert _served(url1) - before[0] == 2 and _served(url2) - before[1] == 2  # round robin took both in turn

    # decode 2 loses its only prefill node: up, but /health and every request answer 503
    nodes.prefills["prefill2"][0].send_signal(signal.SIGKILL)
    wait_until(lambda: _health_status(url2) == 503, 30, "decode 2 to say it is not ready")
    wait_until(lambda: _peers_up(url1) == 1, 30, "decode 1 to drop the lost prefill node")
    served, retries = _served(url1), round_robin.retries()
    for i in range(6):
        _complete(round_robin, f"the lazy dog {i}")  # the router retries decode 2's 503s on decode 1
    assert _served(url1) - served == 6
    assert round_robin.retries() - retries >= 3  # every other request went to decode 2 first
    for router in health_checked:
        wait_until(lambda r=router: not r.healthy(url2), 30, f"{router.url} to mark decode 2 unhealthy")
        assert router.healthy(url1)
        served = _served(url1)
        for i in range(3):
            _complete(router, f"remember it {i}")
        assert _served(url1) - served == 3

    # decode 2 dies: the routers send everything to decode 1
    decode2.send_signal(signal.SIGKILL)
    decode2.wait(30)
    served, retries = _served(url1), round_robin.retries()
    for router in cluster["routers"]:
        for i in range(3):
            _complete(router, f"hello world {i}")
    assert _served(url1) - served == 9
    assert round_robin.retries() > retries  # a refused connection is retried too
    assert get_json(url1 + "/health")["ready"]
