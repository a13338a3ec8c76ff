"""`smartgen simulate`: runs the transfer engine over an in-process paced link under several policies and prints them side by side."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated

import typer

from .errors import fail
from .lists import names
from .options import Blocks, DelayMs, LinkGbps, SpeculativeRatio, StallRatio, option

if TYPE_CHECKING:  # rich and the engine load only when the command runs, so --help stays fast
    from rich.table import Table

    from smartgen.apps.simulate import SimulationResult

PANEL_WORK = "Workload"
PANEL_COMPUTE = "Compute (emulated)"


def simulate(
    schemes: Annotated[
        str,
        typer.Option(
            "--schemes",
            "-p",
            help="Comma-separated schemes to compare: full, partial, partial+profile, partial+profile+parallel, smartgen.",
            rich_help_panel=PANEL_WORK,
        ),
    ] = "full,partial,partial+profile+parallel,smartgen",
    strategy: Annotated[
        str,
        option(
            PANEL_WORK,
            "Proactive-set strategy for the budgeted schemes: profile, random, sequential, streaming, optimal.",
        ),
    ] = "profile",
    lengths: Annotated[
        str, option(PANEL_WORK, "Prompt lengths of the batch, comma-separated (one request each).")
    ] = "4096,3000",
    steps: Annotated[int, option(PANEL_WORK, "Output tokens per request (the first comes from prefill).", min=2)] = 16,
    layers: Annotated[int, option(PANEL_WORK, "Attention layers L of the synthetic model.", min=2)] = 8,
    kv_heads: Annotated[int, option(PANEL_WORK, "KV heads H.", min=1)] = 4,
    head_dim: Annotated[int, option(PANEL_WORK, "Head dimension d.", min=1)] = 64,
    blocks: Blocks = 256,
    select_ratio: Annotated[
        float, option(PANEL_WORK, "Share of tokens the synthetic selector picks per head and step.", min=0.001, max=1.0)
    ] = 0.1,
    speculative_ratio: SpeculativeRatio = 0.1,
    prefill_us_per_token: Annotated[
        float, option(PANEL_COMPUTE, "Emulated prefill compute, microseconds per prompt token (all layers).", min=0.0)
    ] = 30.0,
    stall_ratio: StallRatio = 4.7,
    link_gbps: LinkGbps = 0.0,
    delay_ms: DelayMs = 0.0,
    decode_layer_ms: Annotated[
        float, option(PANEL_COMPUTE, "Emulated decode compute per layer per step, milliseconds.", min=0.0)
    ] = 1.0,
    verify: Annotated[
        bool, typer.Option(help="Check every assembled KV against the ground truth, bit for bit.")
    ] = True,
    seed: Annotated[int, typer.Option(help="Seed of the synthetic cache and selector trace.")] = 0,
) -> None:
    """Compare transfer policies on a synthetic KV cache over a paced in-process link (no model needed).

    The cache, the selector trace and the compute are synthetic (compute is emulated by
    sleeping); plans, masks, pushes, fetches, speculation and pacing are the real engine.
    """
    import torch
    from rich.console import Console
    from rich.progress import Progress

    from smartgen.apps.simulate import SimulationConfig, compare, link_rate_for
    from smartgen.engine.layout import KVLayout
    from smartgen.engine.policy import get_policy

    try:
        try:
            prompt_lengths = tuple(int(x) for x in names(lengths))
        except ValueError:
            raise ValueError(f"--lengths needs comma-separated token counts, e.g. 4096,3000; got {lengths!r}") from None
        if not prompt_lengths or min(prompt_lengths) < 1:
            raise ValueError("--lengths needs positive integers, e.g. 4096,3000")
        chosen = [get_policy(name, strategy=strategy, speculative_ratio=speculative_ratio) for name in names(schemes)]
        if not chosen:
            raise ValueError("--schemes is empty")
        layout = KVLayout(layers, kv_heads, head_dim, torch.float32, num_blocks=blocks)
        config = SimulationConfig(
            layout,
            lengths=prompt_lengths,
            steps=steps,
            select_ratio=select_ratio,
            prefill_seconds_per_token=prefill_us_per_token * 1e-6,
            decode_layer_seconds=decode_layer_ms * 1e-3,
            delay_s=delay_ms * 1e-3,
            seed=seed,
            verify=verify,
        )
        rate = link_gbps if link_gbps > 0 else link_rate_for(config, stall_ratio)
        config = SimulationConfig(**{**{f: getattr(config, f) for f in config.__slots__}, "gbps": rate})
    except ValueError as exc:
        fail(str(exc))
    from smartgen.lanes.rate import transfer_seconds

    console = Console()
    total_kv = sum(layout.kv_bytes(n) for n in prompt_lengths)
    console.print(
        f"[bold]smartgen simulate[/]: {len(prompt_lengths)} requests ({', '.join(map(str, prompt_lengths))} tokens), "
        f"L={layers} H={kv_heads} d={head_dim} fp32, M={blocks}, {total_kv / 2**20:.1f} MiB of KV, "
        f"link {rate:.3f} Gbit/s (full transfer {transfer_seconds(total_kv, rate):.2f} s vs prefill "
        f"{config.prefill_seconds_per_token * max(prompt_lengths):.2f} s), {steps} output tokens"
    )
    with Progress(console=console, transient=True) as progress:
        tasks = {p.name: progress.add_task(p.name, total=steps - 1) for p in chosen}
        results = compare(config, chosen, on_progress=lambda name, step: progress.update(tasks[name], completed=step))
    for table in result_tables(results):
        console.print(table)
    if any(r.mismatches for r in results):
        fail("some assembled KV differed from the ground truth", code=1)


def folding_table(title: str, columns: list[str]) -> Table:
    """A table whose cells fold onto a second line rather than end in "…" on a narrow or piped console.

    The same settings as the bench's tables (smartgen/apps/bench/tables.py), not imported from there: that helper
    is private to the bench, and importing it would load the bench runner and the cluster code here.
    """
    from rich import box
    from rich.table import Table

    table = Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1), collapse_padding=True
    )
    for i, column in enumerate(columns):
        # scheme names stay whole (they are what a reader looks up); the figures fold first
        table.add_column(column, justify="left" if i == 0 else "right", overflow="fold", no_wrap=i == 0)
    return table


def result_tables(results: Sequence[SimulationResult]) -> tuple[Table, Table]:
    """(timings, transfers) of a comparison, one row per policy in the order run: two narrow tables rather than
    one of eleven columns, so that 80 columns hold them with scheme names and headers whole."""
    from rich.text import Text

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.1f}"

    baseline = results[0].mean("ttst") if results else None
    timings = folding_table(
        "timings in ms (means over requests); x first: TTST speed-up vs the first scheme; KV ok: every assembled "
        "KV equal to the ground truth",
        ["scheme", "TTFT", "TTST", "x first", "TBT", "KV ok"],
    )
    transfers = folding_table(
        "MiB moved per path (push: proactive, fetch: on-demand, spec: speculative); od%: on-demand ratio; "
        "local: all KV on the decode node at the end",
        ["scheme", "push", "fetch", "spec", "od%", "local"],
    )
    for r in results:
        ttst = r.mean("ttst")
        timings.add_row(
            Text(r.policy),  # Text: "smartgen[random]" is not markup
            ms(r.mean("ttft")),
            ms(ttst),
            "-" if not (ttst and baseline) else f"{baseline / ttst:.2f}",
            ms(r.mean("tbt")),
            "yes" if r.mismatches == 0 else f"NO ({r.mismatches})",
        )
        transfers.add_row(
            Text(r.policy),
            f"{r.path_bytes['proactive'] / 2**20:.1f}",
            f"{r.path_bytes['on_demand'] / 2**20:.2f}",
            f"{r.path_bytes['speculative'] / 2**20:.1f}",
            f"{r.on_demand_ratio:.1%}".removesuffix("%"),
            "yes" if r.all_local else "no",
        )
    return timings, transfers
