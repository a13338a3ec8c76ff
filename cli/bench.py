"""`smartgen bench`: every scheme over real prefill and decode processes, side by side, in a stated regime."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from smartgen.apps.evalsuite import TASKS  # the task registry; imports no torch, so --help stays fast

from .errors import fail
from .lists import names, numbers
from .rdma_options import device_option, gid_option, port_option, rdma_flags
from .store_options import DbOption

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

PANEL_WORK = "Workload"
PANEL_REGIME = "Regime (link and decode side)"
PANEL_RUN = "Run and output"
PANEL_LOAD = "Load mode"


NORMAL = {"lengths": "2048", "blocks": "1024", "output_tokens": "64", "reps": "3"}
QUICK = {"lengths": "1024", "blocks": "256", "output_tokens": "16", "reps": "1"}
DEFAULT_STRATEGY_OPTION = "random,sequential,streaming,optimal"
DEFAULT_TASKS = ("passkey", "niah_single")  # smartgen.apps.bench.config.DEFAULT_TASKS (here: --help imports no torch)


def bench(
    model: Annotated[
        str,
        typer.Option(
            help="sample (the bundled 6-layer model), sample16 (the bundled 16-layer one), random:LAYERS (the "
            "sample's shape with LAYERS layers and random weights: timing only, e.g. random:32), or a model folder.",
            rich_help_panel=PANEL_WORK,
        ),
    ] = "sample",
    schemes: Annotated[
        str,
        typer.Option(
            help="Schemes, comma-separated (full is required: every ratio is against it): full, partial, "
            "partial+profile, partial+profile+parallel, smartgen-paper (the paper's three paths: proactive push, "
            "parallel fetch, speculative push), smartgen-paper+hints (speculation led by what the selector ranks "
            "just past its budget), smartgen (ours: hints; layer l+1's selection speculated and fetched while "
            "layer l computes; each speculative slice followed by the next as it lands, so the link never idles "
            "while KV is left to send), proactive-only, quant2 (full transfer of 2-bit quantized KV, KIVI/HACK-like: lossy).",
            rich_help_panel=PANEL_WORK,
        ),
    ] = "full,partial,partial+profile,partial+profile+parallel,smartgen-paper,smartgen,proactive-only,quant2",
    strategies: Annotated[
        str,
        typer.Option(
            help="Second comparison: SmartGen with these proactive-set strategies (random, sequential, streaming, "
            "query: the prompt's last query; optimal: the blocks full transfer's run of the same prompt selected, "
            "replayed, the best any proactive set could do; left out of the default in load mode and prefix "
            "sweeps, which have no such run); empty = none.",
            rich_help_panel=PANEL_WORK,
        ),
    ] = DEFAULT_STRATEGY_OPTION,
    selector: Annotated[str, typer.Option(help="KV selector: quest, infinigen, topk.", rich_help_panel=PANEL_WORK)] = (
        "quest"
    ),
    batch: Annotated[
        str, typer.Option(help="Sweep: concurrent requests per round, e.g. 1,2,4.", rich_help_panel=PANEL_WORK)
    ] = "1",
    lengths: Annotated[
        str | None,
        typer.Option(
            help="Sweep: prompt lengths in tokens (default 2048; 1024 with --quick).", rich_help_panel=PANEL_WORK
        ),
    ] = None,
    budget: Annotated[
        str, typer.Option(help="Sweep: selection budget, a share of the prompt.", rich_help_panel=PANEL_WORK)
    ] = "0.2",
    blocks: Annotated[
        str | None,
        typer.Option(help="Sweep: KV blocks M per layer (default 1024; 256 with --quick).", rich_help_panel=PANEL_WORK),
    ] = None,
    speculative_ratio: Annotated[
        str, typer.Option(help="Sweep: share of all blocks pushed per idle notice.", rich_help_panel=PANEL_WORK)
    ] = "0.1",
    prefill_nodes: Annotated[
        str, typer.Option(help="Sweep: number of prefill nodes.", rich_help_panel=PANEL_WORK)
    ] = "1",
    prefix_hit: Annotated[
        str,
        typer.Option(
            help="Sweep: percent of each prompt a prefix cache already holds, e.g. 0,50,75,90 (the nodes run with "
            "their prefix caches on; prompts share that many leading tokens, cached by a warm-up request). "
            "Empty = caches off.",
            rich_help_panel=PANEL_WORK,
        ),
    ] = "",
    prefix_cache: Annotated[
        str,
        typer.Option(
            help="With --prefix-hit: which node's cache holds the prefix: prefill (skips prefill, as in the paper's "
            "setup), decode (skips transfer) or both.",
            rich_help_panel=PANEL_WORK,
        ),
    ] = "prefill",
    output_tokens: Annotated[
        int | None,
        typer.Option(
            min=3,
            help="Tokens generated per request, EOS ignored (default 64; 16 with --quick).",
            rich_help_panel=PANEL_WORK,
        ),
    ] = None,
    stall_ratio: Annotated[
        str,
        typer.Option(
            help="Sweep: pace the link so a full KV transfer of one request takes R x its prefill "
            "(the paper's testbed: about 4.7; 7.1 at 15 Gbit/s).",
            rich_help_panel=PANEL_REGIME,
        ),
    ] = "4.7",
    link_gbps: Annotated[
        str,
        typer.Option(help="Sweep: link rates in Gbit/s instead of --stall-ratio.", rich_help_panel=PANEL_REGIME),
    ] = "",
    decode_ratio: Annotated[
        float | None,
        typer.Option(
            min=0.0001,
            help="Set the decode side too: emulate slower decode compute so an all-local step's link time moves this "
            "share of a step's selected bytes (off: the machine's own speed, reported).",
            rich_help_panel=PANEL_REGIME,
        ),
    ] = None,
    separate_cpus: Annotated[
        bool,
        typer.Option(
            "--separate-cpus/--shared-cpus",
            help="Run the prefill nodes and the decode node on disjoint halves of this machine's CPUs, as on "
            "separate machines, so a prefill node's pushes do not slow the decode node's steps (ignored with "
            "--lane inproc or one CPU).",
            rich_help_panel=PANEL_REGIME,
        ),
    ] = True,
    load_rate: Annotated[
        float | None,
        typer.Option(
            min=0.001,
            help="Load mode: Poisson arrivals at this many requests per second against the decode node's API, "
            "each scheme for --load-duration, instead of rounds; reports goodput (like `vllm bench serve`).",
            rich_help_panel=PANEL_LOAD,
        ),
    ] = None,
    load_duration: Annotated[
        float, typer.Option(min=1.0, help="Load mode: seconds of arrivals per scheme.", rich_help_panel=PANEL_LOAD)
    ] = 30.0,
    slo_ttft: Annotated[
        float, typer.Option(min=0.001, help="Load mode: TTFT objective in seconds.", rich_help_panel=PANEL_LOAD)
    ] = 2.0,
    slo_tbt: Annotated[
        float,
        typer.Option(min=0.0001, help="Load mode: mean-TBT objective in seconds.", rich_help_panel=PANEL_LOAD),
    ] = 0.2,
    lane: Annotated[
        str,
        typer.Option(
            help="Transport between the nodes: tcp, mooncake, nixl or rdma (two processes), or inproc: one "
            "`serve --role both` process, the in-process lane paced the same way (see serve --help).",
            rich_help_panel=PANEL_RUN,
        ),
    ] = "tcp",
    rdma_device: Annotated[str | None, device_option(PANEL_RUN)] = None,
    rdma_port: Annotated[int | None, port_option(PANEL_RUN)] = None,
    gid_index: Annotated[int | None, gid_option(PANEL_RUN)] = None,
    reps: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Measured rounds per point, schemes interleaved; medians and spread are over them (default 3; 1 with "
            "--quick).",
            rich_help_panel=PANEL_RUN,
        ),
    ] = None,
    warmup: Annotated[
        int, typer.Option(min=0, help="Warm-up rounds per point, left out of the stats.", rich_help_panel=PANEL_RUN)
    ] = 1,
    quick: Annotated[
        bool,
        typer.Option(
            help="Small and fast: the defaults of --lengths, --output-tokens, --blocks and --reps drop to 1024, 16, 256 "
            "and 1; every scheme still runs (74 s wall time on the sample model on a busy 2-core machine, profiling "
            "included; meant to stay under 5 minutes).",
            rich_help_panel=PANEL_RUN,
        ),
    ] = False,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Output folder for results.json, summary.csv and PNG figures (default: bench-results/<time>).",
            rich_help_panel=PANEL_RUN,
        ),
    ] = None,
    tasks: Annotated[
        str,
        typer.Option(
            help=f"Eval-suite tasks the prompts come from, in turn, comma-separated: {', '.join(TASKS)}. Accuracy is "
            "scored on them, so naming more widens the accuracy check; an answer longer than --output-tokens (vt's: "
            "40 tokens) is scored cut, and the run notes it.",
            rich_help_panel=PANEL_WORK,
        ),
    ] = ",".join(DEFAULT_TASKS),
    seed: Annotated[int, typer.Option(help="Seed of the prompts and random weights.", rich_help_panel=PANEL_RUN)] = 0,
    db: DbOption = None,
) -> None:
    """Benchmark the schemes side by side over real prefill and decode processes on a paced loopback link."""
    import time

    from rich.console import Console

    from smartgen.apps.bench import BenchConfig, run_bench
    from smartgen.apps.bench.output import write_outputs
    from smartgen.apps.bench.stats import summarize
    from smartgen.apps.bench.tables import load_table, point_tables, prefix_table, regime_line
    from smartgen.store import StoreError

    defaults = QUICK if quick else NORMAL
    lengths = lengths or defaults["lengths"]
    blocks = blocks or defaults["blocks"]
    output_tokens = output_tokens or int(defaults["output_tokens"])
    reps = reps or int(defaults["reps"])
    if strategies == DEFAULT_STRATEGY_OPTION and (load_rate is not None or prefix_hit):
        strategies = strategies.replace(",optimal", "")  # no full-transfer run of the same prompt to replay
    try:
        config = BenchConfig(
            model=model,
            schemes=names(schemes),
            strategies=names(strategies),
            selector=selector,
            lane=lane,
            batch=numbers(batch, "--batch", int),
            lengths=numbers(lengths, "--lengths", int),
            stall_ratio=numbers(stall_ratio, "--stall-ratio", float),
            link_gbps=numbers(link_gbps, "--link-gbps", float),
            decode_ratio=decode_ratio,
            separate_cpus=separate_cpus,
            blocks=numbers(blocks, "--blocks", int),
            budget=numbers(budget, "--budget", float),
            speculative_ratio=numbers(speculative_ratio, "--speculative-ratio", float),
            prefill_nodes=numbers(prefill_nodes, "--prefill-nodes", int),
            prefix_hit=tuple(h / 100 for h in numbers(prefix_hit, "--prefix-hit", float)),
            prefix_cache=prefix_cache,
            output_tokens=output_tokens,
            tasks=names(tasks),
            reps=reps,
            warmup=warmup,
            seed=seed,
            load_rate=load_rate,
            load_duration_s=load_duration,
            slo_ttft_s=slo_ttft,
            slo_tbt_s=slo_tbt,
            db=db,
        )
    except ValueError as exc:
        fail(str(exc))
    config = replace(config, lane_flags=rdma_flags(lane, rdma_device, rdma_port, gid_index))
    from smartgen.lanes.backends import lane_problem

    if problem := lane_problem(lane):
        fail(problem)
    out = out or Path("bench-results") / time.strftime("%Y%m%d-%H%M%S")
    console = Console()
    with phase_bar(console) as (_, progress):
        try:
            result = run_bench(config, say=lambda line: console.print(f"[dim]{line}[/]"), progress=progress)
        except (RuntimeError, ValueError, OSError, StoreError) as exc:
            fail(str(exc), code=1)
    summaries = summarize(result)
    for note in result.notes:
        console.print(f"[yellow]note:[/] {note}")
    for index in range(len(result.points)):
        console.print(f"\n[bold]{regime_line(result, index)}[/]")
        for table in [load_table(result, index)] if result.loads else point_tables(result, summaries, index):
            console.print(table)
    if (sweep := prefix_table(result, summaries)) is not None:
        console.print()
        console.print(sweep)
    written = write_outputs(result, summaries, out)
    console.print(f"\nwrote {', '.join(str(p) for p in written)}")
    if not result.loads and not any(p.suffix == ".png" for p in written):
        console.print("no figures: they need matplotlib (pip install 'smartgen\\[plot]')")


@contextmanager
def phase_bar(console: Console) -> Iterator[tuple[Progress, Callable[[str, int, int | None], None]]]:
    """A transient bar for run_bench's phases and the `progress(what, done, total)` that drives it.

    A new phase (done drops, or the total changes) gets a task of its own, so its elapsed time and ETA are the
    phase's rather than an average over the pilot and the rounds; a phase without a total (loading and profiling
    the model) shows a spinner and its description, and "?" for the count.
    """
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    times = (TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
    with Progress(*columns, *times, console=console, transient=True) as bar:
        task = bar.add_task("starting", total=None)

        def progress(what: str, done: int, total: int | None) -> None:
            nonlocal task
            current = bar.tasks[-1]
            if done < current.completed or total != current.total:  # a new phase: a task of its own
                bar.remove_task(task)
                task = bar.add_task(what[:48], total=total, completed=done)
            else:
                bar.update(task, description=what[:48], completed=done)

        yield bar, progress
