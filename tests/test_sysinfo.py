"""Tests smartgen.sysinfo: the XDG profile-DB path and the guarded RDMA and Triton probes."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from smartgen import sysinfo


def test_db_path_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SMARTGEN_DB", str(tmp_path / "x.db"))
    monkeypatch.setenv("XDG_DATA_HOME", "/elsewhere")
    assert sysinfo.default_db_path() == tmp_path / "x.db"


def test_db_path_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SMARTGEN_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert sysinfo.default_db_path() == tmp_path / "smartgen" / "profiles.db"


@pytest.mark.parametrize("xdg", [None, "", "relative/dir"])
def test_db_path_home_fallback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, xdg: str | None) -> None:
    monkeypatch.delenv("SMARTGEN_DB", raising=False)
    if xdg is None:
        monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    else:
        monkeypatch.setenv("XDG_DATA_HOME", xdg)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert sysinfo.default_db_path() == tmp_path / ".local" / "share" / "smartgen" / "profiles.db"


def _fake_pyverbs(monkeypatch: pytest.MonkeyPatch, get_device_list: object) -> None:
    pkg = types.ModuleType("pyverbs")
    device = types.ModuleType("pyverbs.device")
    device.get_device_list = get_device_list  # type: ignore[attr-defined]
    pkg.device = device  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pyverbs", pkg)
    monkeypatch.setitem(sys.modules, "pyverbs.device", device)


def test_rdma_missing_pyverbs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyverbs", None)  # makes the import raise ImportError
    monkeypatch.setitem(sys.modules, "pyverbs.device", None)
    assert sysinfo.collect_info()["rdma"] == {"status": "pyverbs not installed", "devices": []}


def test_rdma_no_device_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def raising() -> list:
        raise RuntimeError("Failed to get devices list")

    _fake_pyverbs(monkeypatch, raising)
    rdma = sysinfo.collect_info()["rdma"]
    assert rdma["devices"] == []
    assert rdma["status"] == "no RDMA device (Failed to get devices list)"


def test_rdma_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_pyverbs(monkeypatch, lambda: [types.SimpleNamespace(name=b"mlx5_0"), types.SimpleNamespace(name="mlx5_1")])
    assert sysinfo.collect_info()["rdma"] == {"status": "2 device(s)", "devices": ["mlx5_0", "mlx5_1"]}


def test_triton_mode_is_one_of_the_known_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    mode = sysinfo.collect_info()["triton"]
    assert mode in {
        "native (CUDA)",
        "unavailable on CPU without TRITON_INTERPRET=1 (the PyTorch reference path is used)",
        "not installed",
    }


def test_triton_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)
    assert sysinfo.collect_info()["triton"] == "not installed"


def test_the_samples_the_demo_and_profile_default_to_exist():
    assert (sysinfo.SAMPLES_DIR / "calibration.jsonl").is_file()
    assert (sysinfo.SAMPLES_DIR / "sample-model" / "config.json").is_file()
