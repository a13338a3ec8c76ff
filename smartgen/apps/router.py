"""SGLang's router (`sglang-router`, regular mode) from a virtual environment of its own: found or installed, launched.

SmartGen writes no router of its own (see the README's Scale out). The router goes into a venv under the cache folder
(`~/.cache/smartgen/sglang-router-VERSION`), never into SmartGen's environment: it pins its own dependencies. When it
cannot be had (no network, no wheel for this platform), `RouterUnavailable` says why and what to do instead.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

from smartgen.roles.processes import die_with_parent

__all__ = [
    "ROUTER_PACKAGE",
    "POLICIES",
    "RouterUnavailable",
    "router_home",
    "router_importable",
    "ensure_router",
    "router_command",
    "start_router",
    "stop_router",
    "remove_worker",
]

ROUTER_PACKAGE = "sglang-router==0.3.2"  # the version the tests were written against; bump it here on purpose
POLICIES = ("cache_aware", "round_robin", "power_of_two")
INSTALL_TIMEOUT_S = 900.0
HOW = (
    f"install it yourself (python -m venv DIR && DIR/bin/pip install {ROUTER_PACKAGE}) and pass --router-python "
    "DIR/bin/python, or run with --router none"
)


class RouterUnavailable(RuntimeError):
    """The router cannot be had here; the message says why and how to get it."""


def router_home() -> Path:
    """The venv the router is installed into: under $XDG_CACHE_HOME (default ~/.cache)/smartgen."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "smartgen" / ROUTER_PACKAGE.replace("==", "-")


def router_importable(python: Path) -> bool:
    """Whether `python` exists and imports `sglang_router.launch_router`."""
    if not python.exists():
        return False
    probe = [str(python), "-c", "import sglang_router.launch_router"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def _last_error(stderr: str, fallback: str) -> str:
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("ERROR")]  # pip's warnings come first
    return (errors or lines or [fallback])[-1]


def ensure_router(install: bool = True, say: Callable[[str], None] = print, home: Path | None = None) -> Path:
    """A Python with `sglang_router` importable: the cached venv's, made and installed into on first use when
    `install` (a few minutes; `say` hears of it). Raises RouterUnavailable with the reason and the way out."""
    home = home or router_home()
    python = home / "bin" / "python"
    if router_importable(python):
        return python
    if not install:
        raise RouterUnavailable(f"{ROUTER_PACKAGE} is not installed in {home} and installing was turned off: {HOW}")
    say(f"installing {ROUTER_PACKAGE} into {home} (first use only; pip, a minute or more)")
    made = subprocess.run([sys.executable, "-m", "venv", "--clear", str(home)], capture_output=True, text=True)
    if made.returncode != 0:
        raise RouterUnavailable(f"cannot make a venv at {home}: {_last_error(made.stderr, 'venv failed')}; {HOW}")
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", ROUTER_PACKAGE]
    try:
        installed = subprocess.run(pip, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RouterUnavailable(f"pip install {ROUTER_PACKAGE} took over {INSTALL_TIMEOUT_S:.0f} s; {HOW}") from None
    if installed.returncode != 0 or not router_importable(python):
        reason = _last_error(installed.stderr, "it installed, but sglang_router does not import")
        raise RouterUnavailable(f"cannot install {ROUTER_PACKAGE}: {reason}; {HOW}")
    return python


def router_command(
    python: Path,
    workers: list[str],
    policy: str,
    host: str,
    port: int,
    metrics_port: int,
    health_interval_s: int = 2,
) -> list[str]:
    """`python -m sglang_router.launch_router` in regular mode before the decode nodes `workers` (base URLs)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown router policy {policy!r}: one of {', '.join(POLICIES)}")
    command = [str(python), "-m", "sglang_router.launch_router", "--worker-urls", *workers, "--policy", policy]
    command += ["--host", host, "--port", str(port), "--prometheus-host", host, "--prometheus-port", str(metrics_port)]
    # a dead or not-ready node is out of rotation within about two checks (the default checks once a minute);
    # requests in between are retried on another node (the router retries our 503s and refused connections)
    command += ["--health-check-interval-secs", str(health_interval_s), "--health-failure-threshold", "2"]
    command += ["--health-success-threshold", "1", "--health-check-timeout-secs", "5"]
    return command + ["--log-level", "warn"]  # not a line per request: the cluster asks /workers every second


def remove_worker(router_url: str, worker_url: str, timeout: float = 5.0) -> bool:
    """Takes `worker_url` out of the router's rotation at once (`DELETE /workers/{id}`); False where the router does
    not list it. For a node known dead: the health checks would take a few seconds, and cache_aware's retries go back
    to the node a request's prefix points at."""
    with urllib.request.urlopen(f"{router_url}/workers", timeout=timeout) as response:
        workers = json.loads(response.read()).get("workers", [])
    ids = [w["id"] for w in workers if w.get("url", "").rstrip("/") == worker_url.rstrip("/") and "id" in w]
    for worker_id in ids:
        request = urllib.request.Request(f"{router_url}/workers/{worker_id}", method="DELETE")
        urllib.request.urlopen(request, timeout=timeout).close()
    return bool(ids)


def start_router(command: list[str], log: Path) -> subprocess.Popen:
    """The router process, its output in `log`; it gets SIGTERM when this process dies (even by SIGKILL)."""
    with log.open("w") as out:
        return subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
        )


def stop_router(process: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM (the router's graceful stop), then SIGKILL past `timeout` s."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
