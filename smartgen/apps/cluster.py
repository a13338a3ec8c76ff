"""A local deployment for the demo, the benchmark and `smartgen cluster`: prefill node(s) and decode node(s) as real
processes on 127.0.0.1.

With `decode_nodes` > 1 it is xPyD: every decode node uses every prefill node (named decode0, decode1, ...; a single
decode node is named "decode"). Nodes of one role start side by side, prefill nodes first.

With `lane="inproc"` it is one process instead, `serve --role both`: a prefill node and a decode
node joined by the in-process paced lane, with the same HTTP API and prefill status endpoint.

Every node binds port 0 and says where it listens in a ready file, so runs never race for
ports; each node's log goes to a file in the run folder (a pipe nobody reads would fill up
and freeze the node), and its last lines explain a node that exits early.

With `separate_cpus` the prefill nodes and the decode node run on disjoint halves of the CPUs this process
may use, each with as many compute threads as its half has: a deployment puts them on separate machines,
and on one machine a prefill node pushing a request's KV would otherwise take CPU time from the decode
node's steps that no real decode machine loses (and full transfer, whose pushes end before decoding,
would not pay it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smartgen.lanes.backends import INPROC
from smartgen.roles.processes import die_with_parent, read_ready_file, smartgen_command, smartgen_env, stop_processes

__all__ = ["ClusterSpec", "LocalCluster", "post_json", "get_json", "node_cpus", "node_process", "split_cpus"]

READY_TIMEOUT_S = 180.0


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """The flags both roles share, and how many prefill nodes to run."""

    model: Path
    link_gbps: float | None = None  # None: unpaced
    lane: str = "tcp"
    lane_flags: tuple[str, ...] = ()  # `serve` flags for the lane (--rdma-device, --rdma-port, --gid-index)
    blocks: int = 1024
    selector: str = "quest"
    budget: float = 0.2
    speculative_ratio: float = 0.1
    prefill_nodes: int = 1
    decode_nodes: int = 1  # more than one: each uses every prefill node (xPyD)
    max_batch: int = 8
    max_tokens: int = 8192
    db: Path | None = None
    decode_extra: tuple[str, ...] = ()
    prefill_extra: tuple[str, ...] = ()
    # prefix caches (`serve --prefix-cache-bytes`): off unless asked, since the demo and the benchmark send the
    # same prompts to every scheme, and a cache would let later schemes skip what earlier ones paid for
    prefill_cache: str = "0"
    decode_cache: str = "0"
    separate_cpus: bool = False  # prefill nodes and decode node on disjoint CPUs (see the module's docstring)
    device: str = "cpu"  # `serve --device` of every node (cuda:0: both roles' model and the decode pool on the GPU)


def split_cpus() -> tuple[list[int], list[int]] | None:
    """(prefill CPUs, decode CPUs): the CPUs this process may use, halved (the decode node gets the odd one);
    None when there is only one."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return cpus[:half], cpus[half:]


def node_cpus(separate_cpus: bool, lane: str) -> tuple[list[int], list[int]] | None:
    """(prefill CPUs, decode CPUs) of a cluster with these settings, or None where its nodes share the CPUs (not
    asked, one `serve --role both` process on the in-process lane, or one CPU)."""
    return split_cpus() if separate_cpus and lane != INPROC else None


def node_process(env: dict[str, str], cpus: list[int] | None) -> tuple[dict[str, str], Callable[[], None]]:
    """A node's environment and its `Popen(preexec_fn=...)`: it dies with this process and, given `cpus`, runs on
    those CPUs only, with one compute thread per CPU (torch sizes its pool from OMP_NUM_THREADS at start)."""
    if cpus is not None:
        env = {**env, "OMP_NUM_THREADS": str(len(cpus)), "MKL_NUM_THREADS": str(len(cpus))}

    def prepare() -> None:  # in the child, before exec
        die_with_parent()
        if cpus is not None:
            os.sched_setaffinity(0, cpus)

    return env, prepare


@dataclass(slots=True)
class LocalCluster:
    """Starts the nodes on `__enter__`, stops them (SIGINT, then kill) on `__exit__`.

    `run_dir` given: the ready files and logs go there and stay after `__exit__`; else a temporary folder, removed."""

    spec: ClusterSpec
    http: str = ""  # the (first) decode node's HOST:PORT (OpenAI API and /status)
    decode_http: list[str] = field(default_factory=list)  # every decode node's HOST:PORT, in name order
    prefill_status: list[str] = field(default_factory=list)  # each prefill node's status HOST:PORT
    prefill_listen: list[str] = field(default_factory=list)  # each prefill node's HOST:PORT for decode nodes
    run_dir: Path | None = None
    # "prefill0", ..., "decode" (or "both" for an in-process cluster) -> the live process
    nodes: dict[str, subprocess.Popen] = field(default_factory=dict)
    _processes: list[subprocess.Popen] = field(default_factory=list)  # every process started (restarts too)
    _logs: list[Any] = field(default_factory=list)
    _temporary: bool = False  # run_dir is ours to remove

    def __enter__(self) -> LocalCluster:
        if self.run_dir is None:
            self.run_dir, self._temporary = Path(tempfile.mkdtemp(prefix="smartgen-nodes-")), True
        else:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        stop_processes(self._processes)
        for log in self._logs:
            log.close()
        if self.run_dir is not None and self._temporary:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    @property
    def url(self) -> str:
        return f"http://{self.http}"

    @property
    def urls(self) -> list[str]:
        """Every decode node's base URL (OpenAI API, /status, /health), in name order."""
        return [f"http://{address}" for address in self.decode_http]

    @property
    def decode_names(self) -> list[str]:
        """The decode nodes' names: "decode" for one, else decode0, decode1, ..."""
        count = self.spec.decode_nodes
        return ["decode"] if count == 1 else [f"decode{i}" for i in range(count)]

    def status(self) -> dict[str, Any]:
        """The decode node's /status and every prefill node's, as {"decode": ..., "prefill": [...]}."""
        return {
            "decode": get_json(f"{self.url}/status"),
            "prefill": [get_json(f"http://{address}/status") for address in self.prefill_status],
        }

    def _common(self) -> list[str]:
        spec = self.spec
        flags = ["--model", str(spec.model), "--blocks", str(spec.blocks), "--lane", spec.lane, *spec.lane_flags]
        flags += ["--selector", spec.selector, "--budget", str(spec.budget)]
        if spec.device != "cpu":
            flags += ["--device", spec.device]
        if spec.link_gbps is not None:
            flags += ["--link-gbps", f"{spec.link_gbps:.9f}"]
        return flags

    @property
    def cpus(self) -> tuple[list[int], list[int]] | None:
        """(prefill CPUs, decode CPUs) when the nodes run on separate CPUs, else None."""
        return node_cpus(self.spec.separate_cpus, self.spec.lane)

    def _launch(self, name: str, args: list[str]) -> tuple[subprocess.Popen, dict[str, Any]]:
        return self._launch_all([(name, args)])[0]

    def _launch_all(self, nodes: list[tuple[str, list[str]]]) -> list[tuple[subprocess.Popen, dict[str, Any]]]:
        """Starts every (name, serve args) at once, then waits for each one's ready file, in order."""
        started = [self._spawn(name, args) for name, args in nodes]
        return [(process, self._ready(name, process)) for (name, _), process in zip(nodes, started)]

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        assert self.run_dir is not None
        env = {**os.environ, "SMARTGEN_SECRET": os.environ.get("SMARTGEN_SECRET") or "smartgen-local-cluster"}
        if self.spec.db is not None:
            env["SMARTGEN_DB"] = str(self.spec.db)
        split = self.cpus
        cpus = None if split is None else split[1] if name.startswith("decode") else split[0]
        env, prepare = node_process(smartgen_env(env), cpus)

        ready = self.run_dir / f"{name}.json"
        ready.unlink(missing_ok=True)  # a restarted node writes it again
        log_path = self.run_dir / f"{name}.log"
        if not self._temporary and log_path.exists() and name not in self.nodes:
            log_path.unlink()  # a kept run folder used again: this run's log only
        log = log_path.open("a")  # a restarted node adds to its log
        self._logs.append(log)
        command = smartgen_command("serve", *args, "--ready-file", str(ready), *self._common())
        # the nodes die with this process, even when it is killed (a timeout, kill -9) and cannot stop them itself
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=env, preexec_fn=prepare)
        self._processes.append(process)
        self.nodes[name] = process
        return process

    def _ready(self, name: str, process: subprocess.Popen) -> dict[str, Any]:
        assert self.run_dir is not None
        ready, log_path = self.run_dir / f"{name}.json", self.run_dir / f"{name}.log"
        try:
            return read_ready_file(ready, READY_TIMEOUT_S, alive=lambda: process.poll() is None)
        except (RuntimeError, TimeoutError):
            if process.poll() is None:
                raise RuntimeError(f"the {name} node did not come up within {READY_TIMEOUT_S:.0f} s") from None
            lines = log_path.read_text(errors="replace").strip().splitlines()
            raise RuntimeError(f"the {name} node exited early: {lines[-1] if lines else 'no output'}") from None

    @property
    def colocated(self) -> bool:
        """One `serve --role both` process (the in-process lane) rather than one per node."""
        return self.spec.lane == INPROC

    def _start(self) -> None:
        if self.colocated:
            if self.spec.prefill_nodes != 1 or self.spec.decode_nodes != 1:
                raise ValueError("--lane inproc runs one prefill node beside the decode node, in one process")
            self.start_both()
            return
        prefill = [self._prefill_args(i) for i in range(self.spec.prefill_nodes)]
        for _, ready in self._launch_all([(f"prefill{i}", args) for i, args in enumerate(prefill)]):
            self.prefill_listen.append(ready["listen"])
            self.prefill_status.append(ready["status"])
        decode = [(name, self._decode_node_args(i)) for i, name in enumerate(self.decode_names)]
        self.decode_http = [ready["http"] for _, ready in self._launch_all(decode)]
        self.http = self.decode_http[0]

    def _prefill_args(self, index: int) -> list[str]:
        restart = index < len(self.prefill_listen)
        listen = self.prefill_listen[index] if restart else "127.0.0.1:0"
        status = self.prefill_status[index] if restart else "127.0.0.1:0"
        args = ["--role", "prefill", "--listen", listen, "--status", status]
        return args + ["--prefix-cache-bytes", self.spec.prefill_cache, *self.spec.prefill_extra]

    def start_prefill(self, index: int) -> None:
        """Starts prefill node `index`; again on its old addresses when it ran before (a restart after a fault)."""
        restart = index < len(self.prefill_listen)
        _, ready = self._launch(f"prefill{index}", self._prefill_args(index))
        if not restart:
            self.prefill_listen.append(ready["listen"])
            self.prefill_status.append(ready["status"])

    def _decode_args(self, http: str = "") -> list[str]:
        spec = self.spec
        args = ["--http", http or self.http or "127.0.0.1:0"]
        args += ["--max-batch", str(spec.max_batch), "--max-tokens", str(spec.max_tokens)]
        return args + ["--speculative-ratio", str(spec.speculative_ratio)]

    def _decode_node_args(self, index: int) -> list[str]:
        http = self.decode_http[index] if index < len(self.decode_http) else "127.0.0.1:0"
        args = ["--role", "decode", "--prefill", ",".join(self.prefill_listen), *self._decode_args(http)]
        return args + ["--prefix-cache-bytes", self.spec.decode_cache, *self.spec.decode_extra]

    def start_decode(self, index: int = 0) -> None:
        """Starts decode node `index` (again on its old HTTP address after a fault)."""
        if not self.decode_http and self.http:  # a caller that set `http` itself
            self.decode_http = [self.http]
        _, ready = self._launch(self.decode_names[index], self._decode_node_args(index))
        if index == len(self.decode_http):
            self.decode_http.append(ready["http"])
        self.http = self.decode_http[0]

    def start_both(self) -> None:
        """Starts the one colocated process: the prefill node's flags and the decode node's, on the in-process lane."""
        spec = self.spec
        if spec.prefill_cache != spec.decode_cache:  # `serve --prefix-cache-bytes` sizes both halves' caches
            raise ValueError("with --lane inproc the prefill and decode prefix caches are the same size: cache on both")
        args = ["--role", "both", "--status", self.prefill_status[0] if self.prefill_status else "127.0.0.1:0"]
        args += [
            *self._decode_args(),
            "--prefix-cache-bytes",
            spec.decode_cache,
            *spec.prefill_extra,
            *spec.decode_extra,
        ]
        _, ready = self._launch("both", args)
        self.http = ready["http"]
        self.prefill_status = [ready["status"]]

    def log(self, name: str) -> str:
        """What node `name` ("prefill0", "decode") logged so far."""
        assert self.run_dir is not None
        return (self.run_dir / f"{name}.log").read_text(errors="replace")


def post_json(url: str, body: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def get_json(url: str, timeout: float = 30) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())
