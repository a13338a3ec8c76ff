"""xPyD on one machine: prefill nodes, decode nodes that each use every prefill node, and SGLang's router in front.

`smartgen cluster` is a shell over `ScaleOut`, which
1. checks the router's port is free (before anything starts);
2. starts the prefill nodes side by side, then the decode nodes, each on every prefill node (LocalCluster: port 0,
   ready files and logs in the run folder);
3. waits until every decode node is ready (linked with its prefill nodes);
4. starts the router (regular mode, its own venv: smartgen.apps.router) before every decode node, and is ready once
   the router lists each of them healthy;
5. writes cluster.json into the run folder: where everything listens (`smartgen monitor --cluster DIR` reads it);
6. while it runs (`watch()`), takes a decode node whose process exited out of the router at once;
7. on exit stops the router first (no new requests), then the nodes, and removes cluster.json; every process also
   dies with this one.
Without a router (`router=None`) clients pick a decode node themselves.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smartgen.apps.cluster import ClusterSpec, LocalCluster, get_json
from smartgen.apps.cluster_state import LOST, READY, NodeState, node_state
from smartgen.apps.router import remove_worker, router_command, start_router, stop_router
from smartgen.roles.processes import write_ready_file

__all__ = ["RouterSpec", "ScaleOut", "PortTaken", "MANIFEST", "read_manifest"]

MANIFEST = "cluster.json"
ROUTER_READY_TIMEOUT_S = 120.0
NODES_READY_TIMEOUT_S = 60.0  # from the ready files to every decode node linked with every prefill node


class PortTaken(ValueError):
    """The router's port is in use; the message names it and the way out."""


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """The router in front: the Python it runs under (with `sglang_router`), its policy and where it listens."""

    python: Path
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    port: int = 30000  # 0: a free one


def _free_port(host: str, port: int) -> int:
    """`port` if it can be bound on `host` now (a free one for 0), else PortTaken."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the router binds: a TIME_WAIT is no conflict
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise PortTaken(f"cannot listen on {host}:{port} ({exc.strerror}): choose another --port, or 0") from None
        return sock.getsockname()[1]


class ScaleOut:
    """Starts the cluster on `__enter__` (see the module's docstring), stops all of it on `__exit__`."""

    def __init__(self, spec: ClusterSpec, router: RouterSpec | None = None, run_dir: Path | None = None) -> None:
        self.spec, self.router_spec = spec, router
        self.cluster = LocalCluster(spec, run_dir=run_dir)
        self.router: subprocess.Popen | None = None
        self.router_url: str | None = None
        self.metrics_url: str | None = None
        self.removed: set[str] = set()  # decode nodes taken out of the router (their process exited)

    def __enter__(self) -> ScaleOut:
        port = _free_port(self.router_spec.host, self.router_spec.port) if self.router_spec else 0
        self.cluster.__enter__()
        try:
            self._wait_ready()
            if self.router_spec is not None:
                self._start_router(self.router_spec, port)
            assert self.run_dir is not None
            write_ready_file(self.run_dir / MANIFEST, self.manifest())
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.router is not None:
            stop_router(self.router)
        self.cluster.__exit__(None, None, None)
        if self.run_dir is not None:  # a kept run folder keeps its logs, not addresses nothing listens on any more
            (self.run_dir / MANIFEST).unlink(missing_ok=True)

    @property
    def run_dir(self) -> Path | None:
        return self.cluster.run_dir

    @property
    def url(self) -> str:
        """The one URL clients use: the router's, or the first decode node's when there is no router."""
        return self.router_url or self.cluster.url

    def _wait_ready(self) -> None:
        """Until every decode node's /health says ready (it has linked with its prefill nodes)."""
        deadline = time.monotonic() + NODES_READY_TIMEOUT_S
        for name, url in zip(self.cluster.decode_names, self.cluster.urls):
            while (state := node_state(name, "decode", url, self.cluster.nodes.get(name))).state != READY:
                if state.state == LOST or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not get ready ({state.state}: {state.detail})")
                time.sleep(0.1)

    def _start_router(self, spec: RouterSpec, port: int) -> None:
        assert self.run_dir is not None
        self.router_url = f"http://{spec.host}:{port}"
        metrics_port = _free_port(spec.host, 0)
        self.metrics_url = f"http://{spec.host}:{metrics_port}/metrics"
        command = router_command(spec.python, self.cluster.urls, spec.policy, spec.host, port, metrics_port)
        log = self.run_dir / "router.log"
        self.router = start_router(command, log)
        deadline = time.monotonic() + ROUTER_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.router.poll() is not None:
                lines = log.read_text(errors="replace").strip().splitlines()
                raise RuntimeError(f"the router exited ({self.router.returncode}): {lines[-1] if lines else '?'}")
            if self._router_takes_all():
                return
            time.sleep(0.2)
        raise RuntimeError(f"the router did not take every decode node within {ROUTER_READY_TIMEOUT_S:.0f} s ({log})")

    def _router_takes_all(self) -> bool:
        """Whether the router lists every decode node, healthy (refused or not JSON: not listening yet)."""
        try:
            listed = get_json(f"{self.router_url}/workers", timeout=2)
        except (OSError, ValueError):
            return False
        healthy = {w["url"].rstrip("/") for w in listed.get("workers", []) if w.get("is_healthy")}
        return healthy >= set(self.cluster.urls)

    def manifest(self) -> dict[str, Any]:
        """What cluster.json holds: the URL to use, every node's addresses and process id, the router's policy."""
        cluster = self.cluster
        return {
            "url": self.url,
            "router": self.router_url,
            "router_metrics": self.metrics_url,
            "policy": self.router_spec.policy if self.router_spec else None,
            "model": str(self.spec.model),
            "decode": cluster.urls,
            "decode_names": cluster.decode_names,
            "prefill_status": [f"http://{address}" for address in cluster.prefill_status],
            "prefill_listen": list(cluster.prefill_listen),
            "pids": {name: p.pid for name, p in self.processes().items()},
        }

    def processes(self) -> dict[str, subprocess.Popen]:
        """Every process this cluster runs, by name: prefill0.., decode0.. (or decode), router."""
        out = dict(self.cluster.nodes)
        if self.router is not None:
            out["router"] = self.router
        return out

    def states(self) -> list[NodeState]:
        """One row per process, prefill nodes first, the router last (each asked with a short timeout)."""
        cluster = self.cluster
        rows = [
            node_state(f"prefill{i}", "prefill", f"http://{address}", cluster.nodes.get(f"prefill{i}"))
            for i, address in enumerate(cluster.prefill_status)
        ]
        rows += [
            node_state(name, "decode", url, cluster.nodes.get(name))
            for name, url in zip(cluster.decode_names, cluster.urls)
        ]
        if self.router_url is not None:
            rows.append(node_state("router", "router", self.router_url, self.router))
        return rows

    def watch(self) -> list[NodeState]:
        """`states()`, and each decode node found lost (its process exited) taken out of the router at once."""
        rows = self.states()
        for row in rows:
            if row.role == "decode" and row.state == LOST and self.router_url and row.url not in self.removed:
                try:
                    remove_worker(self.router_url, row.url)
                except (OSError, ValueError):
                    continue  # the router is busy or gone: its health checks drop the node, or the next watch does
                self.removed.add(row.url)
        return rows


def read_manifest(run_dir: Path) -> dict[str, Any]:
    """A running cluster's cluster.json (ValueError, saying why, where the folder holds none or a broken one)."""
    path = run_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"no {MANIFEST} in {run_dir}: is a `smartgen cluster --run-dir {run_dir}` running?") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(manifest, dict) or not manifest.get("decode"):
        raise ValueError(f"{path} lists no decode nodes")
    return manifest
