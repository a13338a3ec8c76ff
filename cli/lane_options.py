"""The lane options of the commands that start nodes (`serve`, `bench`, `demo`): `--lane`, the RDMA choice and its
check, where the nodes run."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from .errors import fail
from .options import option

__all__ = ["LANES", "Lane", "RdmaDevice", "RdmaPort", "GidIndex", "SeparateCpus", "check_rdma", "lane_flags"]

LANES = "Lanes"


# -- the options ---------------------------------------------------------------------------------------------
Lane = Annotated[
    str,
    option(
        LANES,
        "Transport for KV and messages, the same on both nodes: tcp, mooncake (smartgen\\[mooncake]), nixl "
        "(smartgen\\[nixl]) or rdma (smartgen\\[rdma]; needs an RDMA device); or inproc, the in-process lane of "
        "--role both (and only of it: bench and demo then start one `serve --role both` process). See "
        "docs/lanes.md. Default: tcp; inproc with serve --role both.",
        show_default=False,
    ),
]
RdmaDevice = Annotated[
    str | None,
    option(
        LANES,
        "--lane rdma: the RDMA device (mlx5_0, rxe0...; `smartgen info` lists them). Default: the one device with "
        "one active port; several is an error that lists them.",
    ),
]
RdmaPort = Annotated[int | None, option(LANES, "--lane rdma: the device's port (default: its one active port).", min=1)]
GidIndex = Annotated[
    int | None,
    option(
        LANES,
        "--lane rdma: the GID index (default: on RoCE the RoCE v2 GID with an IPv4 address, on InfiniBand the first "
        "GID; `smartgen info` shows which it would pick).",
        min=0,
    ),
]
SeparateCpus = Annotated[
    bool,
    typer.Option(
        "--separate-cpus/--shared-cpus",
        help="Run the prefill nodes and the decode node on disjoint halves of this machine's CPUs, as on separate "
        "machines, so a prefill node's pushes do not slow the decode node's steps (ignored with --lane inproc or "
        "one CPU).",
        rich_help_panel=LANES,
    ),
]


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


def lane_flags(lane: str, device: str | None, port: int | None, gid_index: int | None) -> tuple[str, ...]:
    """For the nodes a command starts (`bench`, `demo`): `check_rdma`, then whether `lane` can run here (a one-line
    error if not), then the RDMA choice as `serve` flags."""
    from smartgen.lanes.backends import lane_problem

    check_rdma(lane, device, port, gid_index)  # first: a misplaced option is named even where the lane cannot run
    if problem := lane_problem(lane):
        fail(problem)
    flags: list[str] = []
    for name, value in (("--rdma-device", device), ("--rdma-port", port), ("--gid-index", gid_index)):
        if value is not None:
            flags += [name, str(value)]
    return tuple(flags)
