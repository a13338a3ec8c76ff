"""Reports what this machine offers SmartGen: versions, CUDA and RDMA devices, GPUDirect RDMA, Triton mode, profile DB.

Every probe is guarded: a missing or broken package becomes a line of text in the report,
never an exception, so `smartgen info` is the one command that always works.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

import smartgen

__all__ = ["PACKAGES", "SAMPLES_DIR", "collect_info", "default_db_path"]

# The checkout's samples/ (sample model, calibration set): the demo's and `smartgen profile`'s defaults.
SAMPLES_DIR = Path(__file__).resolve().parent.parent / "samples"

# Distribution names as pip knows them; "smartgen" is read from the package itself.
PACKAGES: tuple[str, ...] = ("torch", "transformers", "triton", "textual", "typer", "sqlite-utils")


def default_db_path() -> Path:
    """The profile database: $SMARTGEN_DB, else $XDG_DATA_HOME/smartgen/profiles.db, else ~/.local/share/smartgen/profiles.db."""
    explicit = os.environ.get("SMARTGEN_DB")
    if explicit:
        return Path(explicit).expanduser()
    data_home = os.environ.get("XDG_DATA_HOME")
    # The XDG spec says a relative $XDG_DATA_HOME is invalid and must be ignored.
    if data_home and Path(data_home).is_absolute():
        base = Path(data_home)
    else:
        base = Path.home() / ".local" / "share"
    return base / "smartgen" / "profiles.db"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"
    except Exception as exc:  # a broken dist-info raises odd things
        return f"error: {exc}"


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "smartgen": smartgen.__version__}
    versions.update({dist: _version(dist) for dist in PACKAGES})
    return versions


def _cuda() -> dict[str, Any]:
    """CUDA devices as torch sees them: {"status": str, "devices": [{"index", "name", "memory_bytes"}]}."""
    try:
        import torch
    except Exception as exc:
        return {"status": f"none (torch not importable: {exc})", "devices": []}
    try:
        if torch.version.cuda is None:
            return {"status": "none (torch built without CUDA)", "devices": []}
        if not torch.cuda.is_available():
            return {"status": "none (no CUDA device visible)", "devices": []}
        devices = []
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append({"index": index, "name": props.name, "memory_bytes": int(props.total_memory)})
    except Exception as exc:
        return {"status": f"none (CUDA probe failed: {exc})", "devices": []}
    return {"status": f"{len(devices)} device(s)", "devices": devices}


def _rdma() -> dict[str, Any]:
    """RDMA devices via pyverbs: {"status": str, "devices": [name], "ports": [{device, port, state, link_layer,
    active_mtu, gids: [{index, gid, type}]}]}, states and types in words; the status says why when there is none."""
    from smartgen.lanes.extras import MissingExtra

    try:
        from smartgen.lanes.rdma.device import describe

        ports = describe()
    except MissingExtra as exc:
        cause = exc.__cause__
        if isinstance(cause, ModuleNotFoundError) and (cause.name or "").startswith("pyverbs"):
            return {"status": "pyverbs not installed (the rdma extra; see docs/lanes.md)", "devices": [], "ports": []}
        return {"status": f"pyverbs not importable ({cause or exc})", "devices": [], "ports": []}
    except Exception as exc:  # RuntimeError("no RDMA device: ...") raised from what the verbs said
        said = str(exc.__cause__ or exc)
        return {"status": f"no RDMA device ({said}){_no_kernel_support()}", "devices": [], "ports": []}
    if not ports:
        return {"status": f"no RDMA device (the verbs list none){_no_kernel_support()}", "devices": [], "ports": []}
    from smartgen.lanes.rdma.select import describe_port

    devices = sorted({row["device"] for row in ports})
    return {"status": f"{len(devices)} device(s)", "devices": devices, "ports": [describe_port(row) for row in ports]}


def _no_kernel_support() -> str:
    """Why the verbs list nothing, where the kernel says: an empty RDMA class in sysfs means no RDMA support loaded."""
    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        return ""
    return "; /sys/class/infiniband is empty: the kernel has no RDMA NIC driver or Soft-RoCE (rdma_rxe) link loaded"


def _gpudirect() -> dict[str, Any]:
    """How the RDMA lane would register GPU memory (CUDA device 0): {"routes": [...], "status": str}; no route means a
    decode pool on the GPU stages through host memory on the one-sided lanes."""
    try:
        from smartgen.lanes.rdma.gpu_memory import gpudirect_status

        routes, reason = gpudirect_status()
    except Exception as exc:
        return {"routes": [], "status": f"unknown (probe failed: {exc})"}
    return {"routes": list(routes), "status": reason}


def _triton_mode() -> str:
    """How smartgen's Triton kernels would run here (see smartgen.engine.kernels.use_triton)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "not installed"
    except Exception as exc:
        return f"not importable ({exc})"
    try:
        import torch

        if torch.cuda.is_available():
            return "native (CUDA)"
    except Exception:
        pass
    if os.environ.get("TRITON_INTERPRET") == "1":
        if os.environ.get("SMARTGEN_FORCE_TRITON") == "1":
            return "interpreter (TRITON_INTERPRET=1)"
        return "interpreter (TRITON_INTERPRET=1; CPU tensors use it only with SMARTGEN_FORCE_TRITON=1)"
    return "unavailable on CPU without TRITON_INTERPRET=1 (the PyTorch reference path is used)"


def collect_info() -> dict[str, Any]:
    """Gathers the report `smartgen info` prints.

    Returns {"versions": {name: version}, "cuda": {"status", "devices"},
    "rdma": {"status", "devices", "ports"}, "gpudirect": {"routes", "status"}, "triton": str, "db_path": str}.
    """
    try:
        db_path = str(default_db_path())
    except Exception as exc:  # Path.home() raises when HOME is unset and no passwd entry exists
        db_path = f"error: {exc}"
    return {
        "versions": _versions(),
        "cuda": _cuda(),
        "rdma": _rdma(),
        "gpudirect": _gpudirect(),
        "triton": _triton_mode(),
        "db_path": db_path,
    }
