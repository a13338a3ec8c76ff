"""The `--rdma-device`, `--rdma-port` and `--gid-index` options, shared by `serve`, `bench` and `demo`, and their check."""

from __future__ import annotations

from typing import Any

import typer

from .errors import fail

__all__ = ["device_option", "port_option", "gid_option", "check_rdma", "rdma_flags"]


def device_option(panel: str) -> Any:
    """The `--rdma-device` option, in `panel` of the command's help."""
    return typer.Option(
        help="--lane rdma: the RDMA device (mlx5_0, rxe0...; `smartgen info` lists them). Default: the one device "
        "with one active port; several is an error that lists them.",
        rich_help_panel=panel,
    )


def port_option(panel: str) -> Any:
    return typer.Option(
        min=1, help="--lane rdma: the device's port (default: its one active port).", rich_help_panel=panel
    )


def gid_option(panel: str) -> Any:
    return typer.Option(
        min=0,
        help="--lane rdma: the GID index (default: on RoCE the RoCE v2 GID with an IPv4 address, on InfiniBand the "
        "first GID; `smartgen info` shows which it would pick).",
        rich_help_panel=panel,
    )


def check_rdma(lane: str, device: str | None, port: int | None, gid_index: int | None) -> Any:
    """The RDMA choice for `--lane`, checked before any model loads: the options with another lane, or a device, port
    or GID the verbs do not list (or that is ambiguous), end the command with a one-line error. Call it before the
    lane's own availability check, so that a misplaced option is named even where that lane cannot run. Returns the
    `RdmaOptions` (imported here: the rdma lane's modules load only when asked for)."""
    from smartgen.lanes.rdma.select import RdmaOptions

    options = RdmaOptions(device, port, gid_index)
    if options != RdmaOptions() and lane != "rdma":
        fail(f"--rdma-device, --rdma-port and --gid-index apply to --lane rdma only, not --lane {lane}")
    if lane == "rdma":
        from smartgen.lanes.backends import lane_problem
        from smartgen.lanes.rdma.device import check_choice

        if problem := lane_problem(lane):  # no pyverbs or no device: say that, not a device-choice error
            fail(problem)

        try:
            check_choice(options)
        except RuntimeError as exc:
            fail(f"--lane rdma: {exc}")
    return options


def rdma_flags(lane: str, device: str | None, port: int | None, gid_index: int | None) -> tuple[str, ...]:
    """`check_rdma`, then the same choice as `serve` flags for the nodes a command starts."""
    check_rdma(lane, device, port, gid_index)
    flags: list[str] = []
    for name, value in (("--rdma-device", device), ("--rdma-port", port), ("--gid-index", gid_index)):
        if value is not None:
            flags += [name, str(value)]
    return tuple(flags)
