"""Shared pytest set-up and helpers: an isolated data home, Triton's interpreter without CUDA, waiting, real nodes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The tests never touch the user's real profile database or data folders: every process they start
# inherits these. Tests of the default location set XDG_DATA_HOME / SMARTGEN_DB themselves.
_DATA_ROOT = Path(tempfile.mkdtemp(prefix="smartgen-tests-"))
os.environ["XDG_DATA_HOME"] = str(_DATA_ROOT / "data")
os.environ["XDG_CONFIG_HOME"] = str(_DATA_ROOT / "config")
os.environ["SMARTGEN_DB"] = str(_DATA_ROOT / "profiles.db")

# triton.jit reads TRITON_INTERPRET when a function is decorated, including triton.language's own
# helpers (tl.cumsum's combine function), so it must be set before anything imports triton. It
# only matters where SMARTGEN_FORCE_TRITON=1 too (tests/test_kernels.py); on CUDA the kernels run natively.
import pytest  # noqa: E402
import torch  # noqa: E402
import uvicorn  # noqa: E402
from hypothesis import settings  # noqa: E402

from smartgen.roles.processes import stop_processes  # noqa: E402

# Hypothesis' per-example deadline is a timed assertion: on this shared 2-core machine a loaded moment fails it
settings.register_profile("smartgen", deadline=None)
settings.load_profile("smartgen")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_unconfigure(config: Any) -> None:
    shutil.rmtree(_DATA_ROOT, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Iterator[None]:
    """A failed test that started nodes gets their output in its report: a flaky fault is diagnosed from one run."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for index, nodes in enumerate(_STARTED_NODES):
            for name, lines in nodes.logs.items():
                report.sections.append((f"node output: pair {index} {name}", "".join(lines[-400:])))
    if call.when == "teardown":
        _STARTED_NODES.clear()


def wait_until(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Polls `condition` until it returns something truthy (returned); OSError counts as not yet."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
            if value:
                return value
        except OSError:
            pass
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def pipeline_text(model_dir: Path, ids: list[int], max_tokens: int, skip_special_tokens: bool = True) -> str:
    """What the in-process pipeline generates for `ids` (greedy, SmartGen, Quest 10%, M = 16): the text a served
    request with the nodes' test flags must equal."""
    from transformers import AutoTokenizer

    from smartgen.engine.policy import get_policy
    from smartgen.runtime.models import load_model
    from smartgen.runtime.pipeline import InprocPipeline

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with InprocPipeline(
        load_model(model_dir), get_policy("smartgen", strategy="streaming"), "quest", {"budget": 0.1}, num_blocks=16
    ) as pipeline:
        [local] = pipeline.generate([ids], max_tokens)
    return tokenizer.decode(local.tokens, skip_special_tokens=skip_special_tokens)


def get_json(url: str, timeout: float = 5) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


@contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """Runs `app` with uvicorn on a free loopback port in a daemon thread; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(5)
        sock.close()


def _drain(process: subprocess.Popen, lines: list[str]) -> None:
    """Reads a node's output as it comes (kept for the test to read), so its pipe never fills."""
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)
    _DRAINED.add(process.pid)


_DRAINED: set[int] = set()
_STARTED_NODES: list[Nodes] = []  # this test's, for its report if it fails


def _eof(process: subprocess.Popen) -> bool:
    return process.pid in _DRAINED


class Nodes:
    """A prefill node (or `num_prefills` of them) and a decode node as `smartgen serve` processes on ports the
    system picks. The first prefill node is `prefill`; all of them are in `prefills` by name (prefill, prefill2...)."""

    def __init__(
        self,
        model_dir: Path,
        run_dir: Path,
        secret: str = "test-secret",
        decode_secret: str | None = None,
        decode_model: Path | None = None,
        extra: tuple[str, ...] = ("--blocks", "16", "--link-gbps", "1"),
        decode_extra: tuple[str, ...] = (),
        num_prefills: int = 1,
        lane: str = "tcp",
    ) -> None:
        self.run_dir = run_dir
        self.logs = {}
        _STARTED_NODES.append(self)
        extra = (*extra, "--lane", lane)  # both nodes: the handshake refuses a mismatch
        run_dir.mkdir(parents=True, exist_ok=True)
        self._launch = [sys.executable, "-m", "smartgen", "serve"]
        self._env = {**os.environ, "SMARTGEN_DB": str(run_dir / "none.db")}
        self._model_dir, self._secret, self._extra = model_dir, secret, extra
        self.decode: subprocess.Popen | None = None
        self.prefills: dict[str, tuple[subprocess.Popen, str, str]] = {}  # name -> (process, listen, status)
        try:
            for index in range(num_prefills):
                self.start_prefill("127.0.0.1:0", "prefill" if index == 0 else f"prefill{index + 1}")
        except BaseException:  # the test never gets the object to stop: stop the nodes already up
            self.stop()
            raise
        addresses = ",".join(listen for _, listen, _ in self.prefills.values())
        self.decode = subprocess.Popen(
            [*self._launch, "--role", "decode", "--model", str(decode_model or model_dir)]
            + ["--prefill", addresses, "--http", "127.0.0.1:0", "--ready-file", str(run_dir / "decode.json")]
            + ["--secret", decode_secret or secret, "--max-tokens", "512", *extra, *decode_extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # one pipe, drained below: a chatty node never blocks on a full pipe
            text=True,
            env=self._env,
        )
        threading.Thread(target=_drain, args=(self.decode, self.logs.setdefault("decode", [])), daemon=True).start()

    logs: dict[str, list[str]]

    def start_prefill(self, listen: str, name: str = "prefill") -> subprocess.Popen:
        """Starts the prefill node on `listen` (port 0 at first; its old address to restart it) and waits for it."""
        ready_file = self.run_dir / f"{name}.json"
        ready_file.unlink(missing_ok=True)
        process = subprocess.Popen(
            [*self._launch, "--role", "prefill", "--model", str(self._model_dir), "--listen", listen]
            + ["--status", "127.0.0.1:0", "--ready-file", str(ready_file), "--secret", self._secret, *self._extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self._env,
        )
        lines = self.logs.setdefault(name, [])
        threading.Thread(target=_drain, args=(process, lines), daemon=True).start()
        try:
            ready = self._ready(f"{name}.json", process)
        except BaseException:  # not ready in time (or exited): it must not outlive the test
            stop_processes([process])
            raise
        self.prefills[name] = (process, ready["listen"], ready["status"])
        if name == "prefill":
            self.prefill = process
            self.prefill_address, self.status_address = ready["listen"], ready["status"]
        return process

    def _ready(self, name: str, process: subprocess.Popen) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            if process.poll() is not None:
                time.sleep(0.2)  # let the drain thread read the last lines
                raise AssertionError(f"{name} node exited: {''.join(self.logs.get(name.split('.')[0], []))}")
            path = self.run_dir / name
            return json.loads(path.read_text()) if path.exists() else None

        return wait_until(ready, 120, f"the node to write {name}")  # a hang guard: a loaded machine starts slowly

    def output(self, name: str) -> str:
        """What node `name` ("decode", "prefill", "prefill2"...) printed so far (after it exits: all of it)."""
        process = self.decode if name == "decode" else self.prefills[name][0]
        if process is not None and process.poll() is not None:
            wait_until(lambda: process.stdout is None or process.stdout.closed or _eof(process), 5, "the output")
        return "".join(self.logs.get(name, []))

    @property
    def status_url(self) -> str:
        return f"http://{self.status_address}/status"

    @property
    def url(self) -> str:
        return f"http://{self.http_address}"

    def wait_ready(self) -> None:
        assert self.decode is not None
        self.http_address = self._ready("decode.json", self.decode)["http"]
        wait_until(lambda: get_json(self.url + "/health")["ready"], 60, "the decode node to be ready")

    def stop(self) -> None:
        stop_processes(
            p for p in (self.decode, *(process for process, _, _ in self.prefills.values())) if p is not None
        )


# -- lanes: every contract test runs on every lane this machine has --------------------------------

# NIXL's UCX backend over loopback TCP: there is no RDMA device here, and shared memory would skip the network
os.environ.setdefault("UCX_TLS", "tcp,self")

LANE_KINDS = ("inproc", "tcp", "mooncake", "nixl", "rdma")
SOCKET_LANES = LANE_KINDS[1:]  # the lanes whose links are made over authenticated sockets (all but in-process)
# The RDMA lane over tests/softverbs.py, a software endpoint inside one process: everything of the lane but the
# verbs calls themselves, on machines without a device. Only where both link ends live in the test's process.
SOFT_RDMA = "rdma-soft"


def soft_rdma_factory(**options: Any) -> Any:
    """The RDMA lane's factory over software endpoints; small bounce buffers so messages arrive in fragments."""
    from softverbs import SoftEndpoint

    from smartgen.lanes.rdma.lane import rdma_lane_for
    from smartgen.lanes.rdma.select import RdmaOptions

    return rdma_lane_for(RdmaOptions(), endpoint=SoftEndpoint, **{"bounce_bytes": 4096, "bounces": 16, **options})


def make_link(name: str, gbps: float | None = None, delay_s: float = 0.0) -> Any:
    """Both ends of a loopback link of this kind in this process (`loopback_link`, plus the soft RDMA lane)."""
    from smartgen.lanes.backends import loopback_link
    from smartgen.lanes.tcp_link import loopback_tcp_link

    if name == SOFT_RDMA:
        return loopback_tcp_link(gbps, delay_s, lane_factory=soft_rdma_factory())
    return loopback_link(name, gbps, delay_s)


@contextmanager
def soft_rdma_nodes() -> Iterator[None]:
    """While open, nodes made in this process with lane="rdma-soft" use the RDMA lane over software endpoints."""
    import smartgen.roles.decode_node as decode_node
    import smartgen.roles.prefill_node as prefill_node

    def factory(name: str, *args: Any, **kwargs: Any) -> Any:
        return soft_rdma_factory() if name == SOFT_RDMA else real(name, *args, **kwargs)

    real = decode_node.lane_factory
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode_node, "lane_factory", factory)
        patch.setattr(prefill_node, "lane_factory", factory)
        yield


def _available(name: str) -> str:
    from smartgen.lanes.backends import unavailable

    if name == SOFT_RDMA:
        return name
    reason = unavailable(name)
    if reason:
        pytest.skip(f"{name} lane unavailable: {reason}")
    return name


def lane_params(*names: str) -> list[Any]:
    """Lane names as parameters; every lane but in-process and TCP carries the `lanes` marker, which keeps those
    variants of the serving, engine and fault tests out of `make test` (run them with `make test-lanes`)."""
    return [name if name in ("inproc", "tcp") else pytest.param(name, marks=pytest.mark.lanes) for name in names]


def lane_available(name: str) -> str:
    """`name` when that lane runs here; otherwise skips the test with what is missing (package, device)."""
    return _available(name)


@pytest.fixture(params=(*LANE_KINDS, SOFT_RDMA))
def lane_kind(request) -> str:
    """A lane backend by name; skipped, with the reason, where its package or device is missing."""
    return _available(request.param)


@pytest.fixture(params=SOCKET_LANES)
def socket_lane_kind(request) -> str:
    """The lanes whose links are made over authenticated sockets (all but in-process)."""
    return _available(request.param)


@pytest.fixture
def remote_read_guard(monkeypatch):
    """Fails the test if any gather reads a pool entry whose mask is not LOCAL at that moment."""
    import smartgen.engine.decode.move as decode_module
    from smartgen.engine.decode import DecodeEngine
    from smartgen.engine.mask import LOCAL

    real_gather = decode_module.gather_kv
    violations = []

    def guarded(k_pool, v_pool, slots, index, start, stop, k_out, v_out):
        pool_k = decode_module_pools[-1]
        layer = next(i for i in range(pool_k.k.shape[0]) if pool_k.k[i].data_ptr() == k_pool.data_ptr())
        mask = pool_k.masks.layer(layer)
        heads = k_pool.shape[2]
        for r in range(index.shape[0]):
            for j in range(int(start[r]), int(stop[r])):
                if int(mask[int(slots[r // heads]), int(index[r, j]), r % heads]) != LOCAL:
                    violations.append((layer, r, j))
        real_gather(k_pool, v_pool, slots, index, start, stop, k_out, v_out)

    decode_module_pools = []
    real_init = DecodeEngine.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        decode_module_pools.append(self.pool)

    monkeypatch.setattr(DecodeEngine, "__init__", init)
    monkeypatch.setattr(decode_module, "gather_kv", guarded)
    return violations
