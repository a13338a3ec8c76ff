"""Node processes from outside: the command and environment that start one, the ready file a node writes once it
listens (its bound addresses, so port 0 works without races), and a graceful stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import smartgen

__all__ = [
    "smartgen_command",
    "smartgen_env",
    "write_ready_file",
    "read_ready_file",
    "stop_processes",
    "die_with_parent",
]

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def smartgen_command(*args: str) -> list[str]:
    """`python -m smartgen ARGS` on this interpreter, without the working directory first on `sys.path` (`-P`,
    Python 3.11+): started from a folder that holds another `smartgen` (an older checkout), `-m` would run that one
    in the nodes while this process runs its own. With `smartgen_env`, the child imports the package this process
    did."""
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-m", "smartgen", *args]


def smartgen_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the folder holding this process's `smartgen` package first on PYTHONPATH (a source tree run
    without installing it, or a copy on PYTHONPATH, is found the same way in the child)."""
    root = str(Path(smartgen.__file__).resolve().parents[1])
    paths = env.get("PYTHONPATH", "")
    return {**env, "PYTHONPATH": os.pathsep.join([root, paths]) if paths else root}


def die_with_parent() -> None:
    """For `Popen(preexec_fn=...)`: the child gets SIGTERM (a node's graceful stop) when the process that started it
    dies, even by SIGKILL, so a killed `smartgen bench` or `demo` leaves no nodes behind. Linux only; else a no-op."""
    import ctypes

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def write_ready_file(path: Path, info: dict[str, Any]) -> None:
    """Writes `info` as JSON atomically (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**info, "pid": os.getpid()}))
    os.replace(tmp, path)


def read_ready_file(path: Path, timeout: float, alive: Any = None) -> dict[str, Any]:
    """Waits up to `timeout` s for a node's ready file; `alive()` returning False (the node exited) stops the wait."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        if alive is not None and not alive():
            raise RuntimeError(f"the node exited before it was ready (no {path.name})")
        time.sleep(0.05)
    raise TimeoutError(f"the node was not ready within {timeout:.0f} s (no {path.name})")


def stop_processes(processes: Iterable[subprocess.Popen], timeout: float = 15) -> None:
    """SIGINT to every process still running, then waits; those not stopped within `timeout` s of the signal are
    killed. One deadline for all: waiting for each in turn let a cluster of n slow starters take n x `timeout`."""
    processes = list(processes)
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
