"""`smartgen info`: prints what this machine offers SmartGen (versions, CUDA, RDMA, GPUDirect, Triton, profile DB)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from smartgen.sysinfo import collect_info


def info(
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the report as JSON (machine-readable) instead of a table.")
    ] = False,
) -> None:
    """Show package versions, CUDA devices, RDMA devices (ports, link layers, GIDs), how the RDMA lane registers GPU
    memory (GPUDirect RDMA), Triton mode and the profile database path."""
    report = collect_info()
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    Console().print(_table(report))


def _table(report: dict[str, Any]) -> Table:
    table = Table(title="SmartGen environment", show_header=True)
    table.add_column("Item", style="bold")
    table.add_column("Value")
    for name, version in report["versions"].items():
        table.add_row(name, version)
    table.add_section()
    table.add_row("CUDA", report["cuda"]["status"])
    for dev in report["cuda"]["devices"]:
        table.add_row(f"  cuda:{dev['index']}", f"{dev['name']} ({dev['memory_bytes'] / 2**30:.1f} GiB)")
    table.add_row("RDMA", report["rdma"]["status"])
    for port in report["rdma"]["ports"]:
        table.add_row(
            f"  {port['device']}:{port['port']}",
            f"{port['state']}, {port['link_layer']}, MTU {port['active_mtu']}; the lane's GID: {port['gid_choice_reason']}",
        )
        for gid in port["gids"]:
            table.add_row(f"    GID {gid['index']}", f"{gid['gid']} ({gid['type']})")
    table.add_row("GPUDirect RDMA", report["gpudirect"]["status"])
    table.add_row("Triton", report["triton"])
    table.add_section()
    table.add_row("Profile DB", report["db_path"])
    return table
