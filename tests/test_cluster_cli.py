"""`smartgen cluster`: real prefill and decode nodes (and SGLang's router) start, serve, show a lost node, and stop.

The command runs as a user runs it, a process of its own with its output in a file; what it started is read back
from cluster.json and the ready files in --run-dir. "Nothing left behind" means: none of the processes it named
still runs, and no process anywhere has the run folder in its command line. The router test needs sglang-router
(tests/test_router.py's venv, made on first use) and skips, saying why, where it cannot be had.
"""

from __future__ import annotations

import http.server
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import get_json, wait_until
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import save_tiny_model
from typer.testing import CliRunner

from smartgen.apps.cluster import ClusterSpec
from smartgen.apps.cluster_state import LOST, NO_ANSWER, NOT_READY, READY, NodeState, node_state
from smartgen.apps.router import RouterUnavailable, ensure_router, remove_worker
from smartgen.apps.scale_out import PortTaken, RouterSpec, ScaleOut
from smartgen.cli.app import app

runner = CliRunner()
MODEL = "tinym"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / MODEL)


# -- mistakes: one line, exit 2 (a router that cannot be had: exit 1, saying how) --------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--model", "{tmp}/nothing"], "no model at"),
        (["--prefix-cache-bytes", "lots"], "--prefix-cache-bytes takes a byte size"),
        (["--router-python", "{tmp}/python"], "cannot import sglang_router"),
    ],
)
def test_mistakes_are_one_line_errors(tmp_path, model_dir, args, says):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = runner.invoke(app, ["cluster", "--model", str(model_dir), *args])
    assert result.exit_code == 2, result.output
    assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_router_that_is_not_installed_says_how_to_get_it(tmp_path, model_dir):
    env = {"XDG_CACHE_HOME": str(tmp_path)}  # an empty cache: no router venv there
    result = runner.invoke(app, ["cluster", "--model", str(model_dir), "--no-install"], env=env)
    assert result.exit_code == 1, result.output
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "sglang-router==" in line and "installing was turned off" in line
    assert "--router-python" in line and "--router none" in line  # the ways out


def test_a_taken_router_port_is_refused_before_any_node_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cluster = ScaleOut(ClusterSpec(model=tmp_path), RouterSpec(Path(sys.executable), port=port), tmp_path)
        with pytest.raises(PortTaken, match=f"127.0.0.1:{port}.*choose another --port"):
            cluster.__enter__()
    assert not cluster.cluster.nodes and not list(tmp_path.iterdir())  # nothing started, nothing written


# -- the table: each process's state from what it answers ------------------------------------------------


@pytest.fixture
def answers() -> Iterator[tuple[str, dict[str, tuple[int, Any]]]]:
    """An HTTP server on 127.0.0.1 answering each path with the (status, JSON) the test puts in the dict."""
    routes: dict[str, tuple[int, Any]] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            code, body = routes.get(self.path, (404, {}))
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_DELETE(self) -> None:  # noqa: N802
            routes.setdefault("deleted", (202, []))[1].append(self.path)
            self.send_response(202)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", routes
    finally:
        server.shutdown()
        server.server_close()


def test_each_process_state_comes_from_its_own_endpoint(answers):
    url, routes = answers
    health = {"ready": True, "prefill_nodes": 2, "running": 1, "prefilling": 1, "parked": 0, "waiting": 3}
    routes["/health"] = (200, health)
    assert node_state("decode0", "decode", url, None) == NodeState(
        "decode0", "decode", url, READY, 2, 3, "2 prefill linked"
    )
    routes["/health"] = (503, {**health, "ready": False, "prefill_nodes": 0})  # no live prefill node: 503
    assert node_state("decode0", "decode", url, None).state == NOT_READY
    routes["/status"] = (200, {"role": "prefill", "requests_open": 1, "requests_held": 2, "bytes_held": 3 * 2**20})
    row = node_state("prefill0", "prefill", url, None)
    assert (row.state, row.running, row.waiting) == (READY, 1, None) and "2 held 3.0 MiB" in row.detail
    routes["/workers"] = (200, {"workers": [{"url": "a", "is_healthy": True}, {"url": "b", "is_healthy": False}]})
    assert node_state("router", "router", url, None).detail == "1/2 healthy"

    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    exited.wait()
    assert node_state("decode1", "decode", url, exited) == NodeState(
        "decode1", "decode", url, LOST, detail="exited with code 3"
    )
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{sock.getsockname()[1]}"
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert node_state("decode1", "decode", refused, alive).state == NO_ANSWER  # running, not answering
    finally:
        alive.kill()
        alive.wait()


def test_a_worker_is_removed_from_the_router_by_its_id(answers):
    url, routes = answers
    listed = [{"id": "a1", "url": "http://127.0.0.1:1/"}, {"id": "b2", "url": "http://127.0.0.1:2"}]
    routes["/workers"] = (200, {"workers": listed})
    assert remove_worker(url, "http://127.0.0.1:1")
    assert not remove_worker(url, "http://127.0.0.1:3")  # not listed: nothing to remove
    assert routes["deleted"][1] == ["/workers/a1"]


def test_the_table_puts_each_value_in_its_column():
    from rich.console import Console

    from smartgen.cli.cluster import _table

    rows = [
        NodeState("prefill0", "prefill", "http://127.0.0.1:1", READY, 0, None, "2 decode linked, 0 held 0.0 MiB"),
        NodeState("decode1", "decode", "http://127.0.0.1:2", LOST, detail="exited with code -9 [killed]"),
    ]
    console = Console(width=160, record=True, file=io.StringIO(), color_system=None)
    console.print(_table(rows))
    lines = console.export_text().splitlines()
    header = [cell.strip() for cell in next(line for line in lines if "node" in line).split("┃")[1:-1]]
    assert header == ["node", "address", "state", "running", "waiting", "detail"]
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in lines if line.startswith("│")]
    assert cells == [
        ["prefill0", "127.0.0.1:1", "ready", "0", "-", "2 decode linked, 0 held 0.0 MiB"],
        ["decode1", "127.0.0.1:2", "lost", "-", "-", "exited with code -9 [killed]"],  # brackets are not markup
    ]


def test_a_stop_signal_whose_exception_python_dropped_still_stops_the_cluster(tmp_path):
    """SIGTERM as a node starts: Python drops the KeyboardInterrupt its handler raises inside a fork's hooks
    (subprocess.Popen), so the serve loop asks the handler's flag each interval and stops all the same."""
    import types

    from smartgen.cli.cluster import StopSignal, _serve

    stop = StopSignal()
    try:
        stop(signal.SIGTERM, None)
    except KeyboardInterrupt:
        pass  # as Python drops it in an at-fork hook ("Exception ignored in _releaseLock")
    running = types.SimpleNamespace(
        router_url=None, cluster=types.SimpleNamespace(urls=["http://127.0.0.1:1"]), run_dir=tmp_path, watch=list
    )
    with pytest.raises(KeyboardInterrupt):
        _serve(running, 1.0, 0.01, stop.check)
    assert not StopSignal().requested  # no signal, no stop: check() passes
    StopSignal().check()


# -- real processes ---------------------------------------------------------------------------------------


class Running:
    """`smartgen cluster ARGS` as a process of its own, its output in run_dir/../cluster.out."""

    def __init__(self, model_dir: Path, run_dir: Path, *args: str, sigint_ignored: bool = False) -> None:
        """`sigint_ignored`: started as a shell script's `smartgen cluster &` is, with SIGINT ignored."""
        self.run_dir, self.out = run_dir, run_dir.with_suffix(".out")
        command = [sys.executable, "-m", "smartgen", "cluster", "--model", str(model_dir), "--run-dir", str(run_dir)]
        command += ["--blocks", "16", "--max-tokens", "512", "--interval", "0.3", *args]
        env = {**os.environ, "SMARTGEN_DB": str(run_dir.with_suffix(".db"))}
        with self.out.open("w") as out:
            ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=ignore)

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 180) -> None:
        def seen() -> bool:
            assert self.process.poll() is None or text in self.output(), f"exited:\n{self.output()}"
            return text in self.output()

        wait_until(seen, timeout, repr(text), interval=0.2)

    def manifest(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "cluster.json").read_text())

    def stop(self, sig: int = signal.SIGINT) -> int:
        self.process.send_signal(sig)
        # a hang guard, not a timing: the nodes get 15 s together to stop, then are killed; a loaded CI machine
        # (two test workers beside other nodes) has taken over 60 s to start and stop one
        try:
            return self.process.wait(180)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"smartgen cluster did not stop; it said:\n{self.output()}") from None


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not reaped yet, does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _left_behind(run_dir: Path, pids: list[int]) -> list[str]:
    """Processes still running that the cluster started: its named pids, and any naming the run folder."""
    left = [f"pid {pid}" for pid in pids if _alive(pid)]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(run_dir) in command and _alive(int(entry.name)):
                left.append(f"{entry.name}: {command[:200]}")
    return left


@pytest.fixture
def cleanup() -> Iterator[list[Running]]:
    """Kills whatever a failed test left running (the nodes die with the command: PR_SET_PDEATHSIG)."""
    started: list[Running] = []
    yield started
    for running in started:
        if running.process.poll() is None:
            running.process.kill()
            running.process.wait(30)


def _complete(url: str, prompt: str) -> dict[str, Any]:
    import httpx

    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    answer = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _served(url: str) -> int:
    """Requests the decode node at `url` took (its e2e histogram's count)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    name = "smartgen:e2e_request_latency_seconds_count"
    return int(sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name))


@pytest.mark.slow  # three node processes start: about 20 s here
def test_nodes_without_a_router_serve_show_a_lost_node_and_ctrl_c_leaves_nothing(tmp_path, model_dir, cleanup):
    # started as a script's `cmd &` starts it: SIGINT ignored (a test run in the background once hung here)
    args = ("--router", "none", "--prefill", "1", "--decode", "2")
    running = Running(model_dir, tmp_path / "run", *args, sigint_ignored=True)
    cleanup.append(running)
    running.wait_for("Ctrl-C stops everything")
    manifest = running.manifest()
    assert manifest["router"] is None and manifest["decode_names"] == ["decode0", "decode1"]
    assert sorted(manifest["pids"]) == ["decode0", "decode1", "prefill0"]
    out = running.output()
    assert "no router; decode nodes at" in out and all(url in out for url in manifest["decode"])
    for name in manifest["pids"]:  # the first table: every node ready
        assert any(name in line and " ready " in line for line in out.splitlines()), out
    for url in manifest["decode"]:  # each decode node serves through the one prefill node
        assert _complete(url, "the quick brown fox")["usage"]["completion_tokens"] >= 1
        health = get_json(url + "/health")
        assert health["ready"] and health["prefill_nodes"] == 1

    os.kill(manifest["pids"]["decode1"], signal.SIGKILL)
    running.wait_for("decode1 lost: exited with code -9", 30)
    assert _complete(manifest["decode"][0], "still here")  # the other decode node goes on

    pids = [manifest["pid"], *manifest["pids"].values()]
    assert running.stop(signal.SIGINT) == 0
    assert "stopped: every node" in running.output()
    assert _left_behind(running.run_dir, pids) == []
    assert (running.run_dir / "decode0.log").exists()  # --run-dir is kept, logs and all
    assert not (running.run_dir / "cluster.json").exists()  # but not the addresses: nothing listens there now


@pytest.mark.slow
def test_sigterm_while_starting_leaves_nothing(tmp_path, model_dir, cleanup):
    running = Running(model_dir, tmp_path / "run", "--router", "none", "--prefill", "2", "--decode", "1")
    cleanup.append(running)
    wait_until(lambda: (running.run_dir / "prefill0.json").exists(), 180, "the first prefill node", interval=0.1)
    ready = json.loads((running.run_dir / "prefill0.json").read_text())
    assert running.stop(signal.SIGTERM) == 0, running.output()
    assert "stopped: every node" in running.output()
    assert _left_behind(running.run_dir, [ready["pid"]]) == []


@pytest.fixture(scope="module")
def router_python() -> Path:
    try:
        return ensure_router(say=lambda line: None)
    except RouterUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.slow
def test_two_by_two_behind_the_router_serves_through_both_drops_a_lost_one_and_stops(
    tmp_path, model_dir, router_python, cleanup
):
    args = ["--prefill", "2", "--decode", "2", "--port", "0", "--policy", "round_robin"]
    running = Running(model_dir, tmp_path / "run", *args, "--router-python", str(router_python))
    cleanup.append(running)
    running.wait_for("Ctrl-C stops everything")
    manifest = running.manifest()
    url, decode = manifest["url"], manifest["decode"]
    assert url == manifest["router"] and f"use {url}/v1" in running.output()
    assert sorted(manifest["pids"]) == ["decode0", "decode1", "prefill0", "prefill1", "router"]
    for address in decode:  # xPyD: every decode node on both prefill nodes
        assert get_json(address + "/health")["prefill_nodes"] == 2
    assert any("router" in line and "2/2 healthy" in line for line in running.output().splitlines())

    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    before = [_served(address) for address in decode]
    for i in range(4):
        completion = client.completions.create(model=MODEL, prompt=f"the pass key is {i}", max_tokens=3)
        assert completion.usage.completion_tokens >= 1
    assert [_served(a) - b for a, b in zip(decode, before)] == [2, 2]  # round robin: both decode nodes served

    os.kill(manifest["pids"]["decode0"], signal.SIGKILL)
    running.wait_for("decode0 lost: exited with code -9", 30)
    # the cluster takes the dead node out of the router at once (not after its health checks)
    running.wait_for("router ready: 1/1 healthy", 30)
    assert [w["url"].rstrip("/") for w in get_json(url + "/workers")["workers"]] == [decode[1]]
    served = _served(decode[1])
    for i in range(3):
        client.completions.create(model=MODEL, prompt=f"hello again {i}", max_tokens=3)
    assert _served(decode[1]) - served == 3

    pids = [manifest["pid"], *manifest["pids"].values()]
    assert running.stop(signal.SIGINT) == 0
    assert "stopped: every node and the router" in running.output()
    assert _left_behind(running.run_dir, pids) == []


@pytest.mark.slow  # a venv is made (ensurepip): about 15 s here
def test_a_router_pip_cannot_install_gives_pips_reason_and_the_way_out(tmp_path, model_dir):
    env = {"XDG_CACHE_HOME": str(tmp_path), "PIP_NO_INDEX": "1"}  # as on a machine without a package index
    result = runner.invoke(app, ["cluster", "--model", str(model_dir)], env=env)
    assert result.exit_code == 1, result.output
    progress, error = result.stderr.strip().splitlines()
    assert progress.startswith("installing sglang-router==") and "first use only" in progress
    assert "cannot install sglang-router" in error and "No matching distribution" in error
    assert "--router-python" in error and "--router none" in error
