"""What the RDMA verbs report about this machine (devices, ports, GIDs): thin pyverbs calls, for selection and `info`."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from smartgen.lanes.extras import require
from smartgen.lanes.rdma.select import Choice, GidInfo, PortInfo, RdmaOptions, choose_gid, choose_port

__all__ = ["pyverbs", "probe", "list_ports", "list_gids", "describe", "check_choice"]

PYVERBS_HINT = "pyverbs, see docs/lanes.md: Debian's python3-pyverbs or the PyPI sdist with Cython<3.1"


def pyverbs() -> ModuleType:
    """The pyverbs.device module, or MissingExtra naming the extra and the install routes."""
    return require("pyverbs.device", "rdma", PYVERBS_HINT)


def probe() -> None:
    """Raises with the reason when no RDMA device is usable here (no pyverbs, no device, no active port)."""
    ports = list_ports()
    if not ports:
        raise RuntimeError("no RDMA device: the verbs list none (no NIC, driver or Soft-RoCE link)")


def list_ports() -> list[PortInfo]:
    """Every port of every device; [] when the verbs find no device (pyverbs raises for that)."""
    device = pyverbs()
    try:
        devices = device.get_device_list()
    except Exception as exc:  # PyverbsRDMAError "Failed to get devices list" when the kernel has no RDMA support
        raise RuntimeError(f"no RDMA device: {exc} (no InfiniBand support in the kernel, or no NIC)") from exc
    ports = []
    for dev in devices:
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        with device.Context(name=name) as ctx:
            for port in range(1, ctx.query_device().phys_port_cnt + 1):
                attr = ctx.query_port(port)
                ports.append(PortInfo(name, port, attr.state, attr.link_layer, attr.active_mtu))
    return ports


def list_gids(ctx: Any, port: int) -> list[GidInfo]:
    """The port's GID table (index, GID, RoCE type)."""
    gids = []
    for index in range(ctx.query_port(port).gid_tbl_len):
        try:
            gid = str(ctx.query_gid(port, index))
            gid_type = ctx.query_gid_type(port, index)
        except Exception:  # unpopulated entries raise on some providers
            continue
        gids.append(GidInfo(index, gid, gid_type))
    return gids


def describe() -> list[dict[str, Any]]:
    """Devices, ports, link layers and GIDs, for `smartgen info`."""
    device = pyverbs()
    rows = []
    for port in list_ports():
        with device.Context(name=port.device) as ctx:
            gids = [{"index": g.index, "gid": g.gid, "type": g.gid_type} for g in list_gids(ctx, port.port)]
        rows.append(
            {
                "device": port.device,
                "port": port.port,
                "state": port.state,
                "link_layer": port.link_layer,
                "active_mtu": port.active_mtu,
                "gids": gids,
            }
        )
    return rows


def check_choice(options: RdmaOptions) -> tuple[Choice, int]:
    """The port and GID index the lane will use for these options; RuntimeError saying what is wrong or ambiguous."""
    ports = list_ports()
    choice = choose_port(ports, options.device, options.port)
    link_layer = next(p.link_layer for p in ports if (p.device, p.port) == (choice.device, choice.port))
    with pyverbs().Context(name=choice.device) as ctx:
        return choice, choose_gid(list_gids(ctx, choice.port), link_layer, options.gid_index)
