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


class _FakeContext:
    """What pyverbs' Context answers for one device: ports (state, link layer, MTU) and their GID tables."""

    def __init__(self, ports: dict[int, tuple[int, int, int, list[tuple[str, int]]]]) -> None:
        self.ports = ports

    def __enter__(self) -> _FakeContext:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def query_device(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(phys_port_cnt=len(self.ports))

    def query_port(self, port: int) -> types.SimpleNamespace:
        state, link_layer, mtu, gids = self.ports[port]
        return types.SimpleNamespace(state=state, link_layer=link_layer, active_mtu=mtu, gid_tbl_len=len(gids) + 1)

    def query_gid(self, port: int, index: int) -> str:
        gids = self.ports[port][3]
        if index >= len(gids):
            raise RuntimeError("empty GID entry")  # as some providers do for unpopulated entries
        return gids[index][0]

    def query_gid_type(self, port: int, index: int) -> int:
        return self.ports[port][3][index][1]


def _fake_pyverbs(monkeypatch: pytest.MonkeyPatch, get_device_list: object, contexts: dict | None = None) -> None:
    pkg = types.ModuleType("pyverbs")
    device = types.ModuleType("pyverbs.device")
    device.get_device_list = get_device_list  # type: ignore[attr-defined]
    device.Context = lambda name: _FakeContext((contexts or {})[name])  # type: ignore[attr-defined]
    pkg.device = device  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pyverbs", pkg)
    monkeypatch.setitem(sys.modules, "pyverbs.device", device)


def test_rdma_missing_pyverbs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyverbs", None)  # makes the import raise ImportError
    monkeypatch.setitem(sys.modules, "pyverbs.device", None)
    rdma = sysinfo.collect_info()["rdma"]
    assert rdma == {"status": "pyverbs not installed (the rdma extra; see docs/lanes.md)", "devices": [], "ports": []}


def test_rdma_no_device_says_what_the_verbs_and_the_kernel_say(monkeypatch: pytest.MonkeyPatch) -> None:
    def raising() -> list:
        raise RuntimeError("Failed to get devices list")

    _fake_pyverbs(monkeypatch, raising)
    rdma = sysinfo.collect_info()["rdma"]
    assert rdma["devices"] == [] and rdma["ports"] == []
    assert rdma["status"].startswith("no RDMA device (Failed to get devices list)")
    if not (Path("/sys/class/infiniband").is_dir() and any(Path("/sys/class/infiniband").iterdir())):
        assert "/sys/class/infiniband is empty" in rdma["status"]


def test_rdma_lists_ports_link_layers_and_gids(monkeypatch: pytest.MonkeyPatch) -> None:
    roce = [("fe80:0000:0000:0000:0202:c9ff:fe00:0001", 0), ("0000:0000:0000:0000:0000:ffff:0a00:0001", 1)]
    contexts = {
        "mlx5_0": {1: (4, 2, 5, roce), 2: (1, 2, 3, [])},  # RoCE: port 1 active (MTU 4096), port 2 down
        "mlx5_1": {1: (4, 1, 4, [("fe80:0000:0000:0000:0002:c903:0001:0002", 0)])},  # InfiniBand
    }
    _fake_pyverbs(
        monkeypatch, lambda: [types.SimpleNamespace(name=b"mlx5_0"), types.SimpleNamespace(name="mlx5_1")], contexts
    )
    rdma = sysinfo.collect_info()["rdma"]
    assert rdma["status"] == "2 device(s)" and rdma["devices"] == ["mlx5_0", "mlx5_1"]
    first, down, infiniband = rdma["ports"]
    assert (first["device"], first["port"], first["state"], first["link_layer"], first["active_mtu"]) == (
        "mlx5_0",
        1,
        "ACTIVE",
        "Ethernet",
        4096,
    )
    assert [(g["index"], g["type"]) for g in first["gids"]] == [(0, "RoCE v1"), (1, "RoCE v2")]
    assert first["gid_choice"] == 1  # the RoCE v2 GID with an IPv4 address
    assert (down["state"], down["gids"], down["gid_choice"]) == ("DOWN", [], None)
    assert "no GID" in down["gid_choice_reason"]
    assert (infiniband["link_layer"], infiniband["gids"][0]["type"], infiniband["gid_choice"]) == (
        "InfiniBand",
        "IB",
        0,
    )


def test_info_prints_every_port_and_gid(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from smartgen.cli.app import app

    contexts = {"rxe0": {1: (4, 2, 3, [("0000:0000:0000:0000:0000:ffff:c0a8:0102", 1)])}}
    _fake_pyverbs(monkeypatch, lambda: [types.SimpleNamespace(name="rxe0")], contexts)
    result = CliRunner().invoke(app, ["info"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "rxe0:1" in result.output and "ACTIVE, Ethernet, MTU 1024; the lane's GID: index 0" in result.output
    assert "GID 0" in result.output and "0000:0000:0000:0000:0000:ffff:c0a8:0102 (RoCE v2)" in result.output


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


def test_the_rdma_choice_is_checked_against_what_the_verbs_list(monkeypatch: pytest.MonkeyPatch) -> None:
    from smartgen.lanes.rdma.device import check_choice
    from smartgen.lanes.rdma.select import RdmaOptions

    roce = [("fe80:0000:0000:0000:0202:c9ff:fe00:0001", 0), ("0000:0000:0000:0000:0000:ffff:0a00:0001", 1)]
    contexts = {"mlx5_0": {1: (4, 2, 5, roce)}, "mlx5_1": {1: (4, 1, 4, [("fe80::2", 0)])}}
    devices = [types.SimpleNamespace(name="mlx5_0"), types.SimpleNamespace(name="mlx5_1")]
    _fake_pyverbs(monkeypatch, lambda: devices, contexts)
    with pytest.raises(RuntimeError, match="several active RDMA ports .*--rdma-device"):
        check_choice(RdmaOptions())
    choice, gid = check_choice(RdmaOptions(device="mlx5_0"))
    assert (choice.device, choice.port, gid) == ("mlx5_0", 1, 1)
    assert check_choice(RdmaOptions(device="mlx5_0", gid_index=0))[1] == 0
    with pytest.raises(RuntimeError, match="GID index 5 is empty"):
        check_choice(RdmaOptions(device="mlx5_0", gid_index=5))
    with pytest.raises(RuntimeError, match="no RDMA device 'mlx9'"):
        check_choice(RdmaOptions(device="mlx9"))
    with pytest.raises(RuntimeError, match="has no port 2"):
        check_choice(RdmaOptions(device="mlx5_1", port=2))
