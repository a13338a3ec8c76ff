"""`smartgen demo`: a prefill node and a decode node over a paced loopback link, full transfer vs SmartGen side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from smartgen.sysinfo import SAMPLES_DIR

from .errors import fail

DEFAULT_MODEL = SAMPLES_DIR / "sample-model"


def demo(
    model: Annotated[Path, typer.Option(help="Model folder (default: the bundled sample model).")] = DEFAULT_MODEL,
    db: Annotated[
        Path | None,
        typer.Option(help="Profile database (default: $SMARTGEN_DB or the XDG data dir); profiled once when empty."),
    ] = None,
    calibration: Annotated[
        Path | None,
        typer.Option(
            help="Calibration JSONL used when the model has no profile yet (default: samples/calibration.jsonl)."
        ),
    ] = None,
    schemes: Annotated[
        str,
        typer.Option(help="Schemes to compare, comma-separated (full, partial, partial+profile+parallel, smartgen)."),
    ] = "full,smartgen",
    length: Annotated[int, typer.Option(min=256, help="Prompt length in tokens.")] = 2048,
    per_task: Annotated[int, typer.Option(min=1, help="Prompts per task (passkey and single-needle retrieval).")] = 3,
    selector: Annotated[str, typer.Option(help="KV selector on the decode node: quest, infinigen or topk.")] = "quest",
    budget: Annotated[float, typer.Option(min=0.01, help="Selection budget as a share of the prompt.")] = 0.2,
    blocks: Annotated[int, typer.Option(min=1, help="KV blocks M per layer.")] = 1024,
    transfer_ratio: Annotated[
        float, typer.Option(min=0.5, help="Pace the link so a full KV transfer takes this many times the prefill.")
    ] = 5.0,
    lane: Annotated[
        str, typer.Option(help="Transport between the two nodes: tcp, mooncake, nixl or rdma (see `serve --help`).")
    ] = "tcp",
) -> None:
    """Run the main job: two real nodes over a paced loopback link, schemes side by side (a few minutes)."""
    from rich.console import Console
    from rich.table import Table

    from smartgen.apps.demo import DemoConfig, run_demo
    from smartgen.store import StoreError

    if not (model / "config.json").exists():
        fail(f"no model at {model} (the sample model lives in samples/sample-model)")
    console = Console()
    config = DemoConfig(
        model=model,
        db=db,
        calibration=calibration,
        schemes=tuple(s.strip() for s in schemes.split(",") if s.strip()),
        length=length,
        per_task=per_task,
        selector=selector,
        blocks=blocks,
        budget=budget,
        transfer_ratio=transfer_ratio,
        lane=lane,
    )
    try:
        results, setup = run_demo(config, say=lambda line: console.print(f"[dim]{line}[/]"))
    except (RuntimeError, ValueError, OSError, StoreError) as exc:
        fail(str(exc), code=1)
    table = Table(
        title=f"{setup['model']}, {setup['prompt_tokens']} prompt tokens, {setup['selector']}, "
        f"link {setup['link_gbps'] * 1000:.1f} Mbit/s (full transfer {setup['transfer_s']:.2f} s, prefill {setup['prefill_s']:.2f} s)"
    )
    for column in ("scheme", "TTFT ms", "TTST ms", "mean TBT ms", "answers correct", "TTST vs first"):
        table.add_column(column, justify="left" if column == "scheme" else "right")
    first = results[0].mean("ttst") if results else None

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.0f}"

    for r in results:
        ttst = r.mean("ttst")
        correct = f"{sum(r.scores):.0f}/{len(r.scores)}" + (f" ({len(r.errors)} failed)" if r.errors else "")
        table.add_row(
            r.scheme,
            ms(r.mean("ttft")),
            ms(ttst),
            ms(r.mean("tbt")),
            correct,
            "-" if not (first and ttst) else f"{first / ttst:.2f}x",
        )
    console.print(table)
