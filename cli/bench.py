"""`smartgen bench`: every scheme over real prefill and decode processes, side by side, in a stated regime."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from smartgen.apps.evalsuite import TASKS  # the task registry; imports no torch, so --help stays fast

from .errors import fail
from .lane_options import GidIndex, Lane, RdmaDevice, RdmaPort, SeparateCpus, lane_flags
from .lists import names, numbers
from .options import (
    LINK,
    NATIVE,
    SELECTION,
    BudgetList,
    DecodeRatio,
    Device,
    LinkGbpsList,
    Selector,
    SpeculativeRatioList,
    StallRatioList,
    option,
    parse_decode_ratio,
)
from .progress import progress_bar
from .sizes import parse_size
from .store_options import Db

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

    from smartgen.apps.bench.config import TraceSpec

PANEL_WORK = "Workload"
PANEL_RUN = "Run and output"
PANEL_LOAD = "Load mode"
PANEL_TRACE = "Trace mode"


NORMAL = {"lengths": "2048", "blocks": "1024", "output_tokens": "64", "reps": "3"}
QUICK = {"lengths": "1024", "blocks": "256", "output_tokens": "16", "reps": "1"}
DEFAULT_STRATEGY_OPTION = "random,sequential,streaming,optimal"
DEFAULT_TASKS = ("passkey", "niah_single")  # smartgen.apps.bench.config.DEFAULT_TASKS (here: --help imports no torch)


def bench(
    model: Annotated[
        str,
        option(
            PANEL_WORK,
            "sample (the bundled 6-layer model), sample16 (the bundled 16-layer one), random:LAYERS (the "
            "sample's shape with LAYERS layers and random weights: timing only, e.g. random:32), or a model folder.",
        ),
    ] = "sample",
    schemes: Annotated[
        str,
        option(
            PANEL_WORK,
            "Schemes, comma-separated (full is required: every ratio is against it): full, partial, "
            "partial+profile, partial+profile+parallel, smartgen-paper (the paper's three paths: proactive push, "
            "parallel fetch, speculative push), smartgen-paper+hints (speculation led by what the selector ranks "
            "just past its budget), smartgen (ours: hints; layer l+1's selection speculated and fetched while "
            "layer l computes; each speculative slice followed by the next as it lands, so the link never idles "
            "while KV is left to send; the first step's forecast, whose token is the second; the prefill node decoding on while idle (head start); speculation scheduled on the link behind proactive "
            "sets), smartgen-no-forecast, smartgen-no-second-token, smartgen-no-head-start, smartgen-eager-proactive, smartgen-unscheduled, smartgen-no-prefetch and smartgen-no-hints (its ablations), smartgen-attend (its misses attended where the KV is, not fetched), proactive-only, quant2 (full "
            "transfer of 2-bit quantized KV, KIVI/HACK-like: lossy).",
        ),
    ] = "full,partial,partial+profile,partial+profile+parallel,smartgen-paper,smartgen,proactive-only,quant2",
    strategies: Annotated[
        str,
        option(
            PANEL_WORK,
            "Second comparison: SmartGen with these proactive-set strategies (random, sequential, streaming, "
            "query: the prompt's last query; optimal: the blocks full transfer's run of the same prompt selected, "
            "replayed, the best any proactive set could do; left out of the default in load mode and prefix "
            "sweeps, which have no such run); empty = none.",
        ),
    ] = DEFAULT_STRATEGY_OPTION,
    selector: Selector = "quest",
    batch: Annotated[str, option(PANEL_WORK, "Sweep: concurrent requests per round, e.g. 1,2,4.")] = "1",
    lengths: Annotated[
        str | None, option(PANEL_WORK, "Sweep: prompt lengths in tokens (default 2048; 1024 with --quick).")
    ] = None,
    budget: BudgetList = "0.2",
    blocks: Annotated[
        str, option(SELECTION, "One or more, comma-separated: KV blocks M per layer (default 1024; 256 with --quick).")
    ] = "",
    speculative_ratio: SpeculativeRatioList = "0.1",
    prefill_nodes: Annotated[str, option(PANEL_WORK, "Sweep: number of prefill nodes.")] = "1",
    prefix_hit: Annotated[
        str,
        option(
            PANEL_WORK,
            "Sweep: percent of each prompt a prefix cache already holds, e.g. 0,50,75,90 (the nodes run with "
            "their prefix caches on; prompts share that many leading tokens, cached by a warm-up request). "
            "Empty = caches off.",
        ),
    ] = "",
    prefix_cache: Annotated[
        str,
        option(
            PANEL_WORK,
            "With --prefix-hit: which node's cache holds the prefix: prefill (skips prefill, as in the paper's "
            "setup), decode (skips transfer) or both.",
        ),
    ] = "prefill",
    output_tokens: Annotated[
        int | None,
        option(PANEL_WORK, "Tokens generated per request, EOS ignored (default 64; 16 with --quick).", min=3),
    ] = None,
    stall_ratio: StallRatioList = "4.7",
    link_gbps: LinkGbpsList = "",
    decode_ratio: DecodeRatio = NATIVE,
    decode_emulation: Annotated[
        str,
        option(
            LINK,
            "How --decode-ratio's slower decode device is emulated: `added` sleeps the same time in every decode "
            "layer, so a batch's step costs this CPU's compute for the batch plus the emulation (on this kind of "
            "machine it grows about linearly with the batch); `floor` tops every layer up to the target step's "
            "share of compute (the step thread's own CPU), so a batch's step costs what one request's does while "
            "the CPU fits under it, as on a GPU. Link waits come on top in both.",
            metavar="<added|floor>",
        ),
    ] = "added",
    separate_cpus: SeparateCpus = True,
    device: Device = "cpu",
    load_rate: Annotated[
        str,
        option(
            PANEL_LOAD,
            "Load mode: Poisson arrivals at this many requests per second against the decode node's API, each scheme "
            "for --load-duration, instead of rounds; reports goodput (like `vllm bench serve`). A comma list is a "
            "sweep: one run per rate and scheme, and goodput.png draws goodput against the rate. With --trace, each "
            "rate rescales the trace's arrival times to that mean rate (instead of --time-scale).",
        ),
    ] = "",
    load_duration: Annotated[float, option(PANEL_LOAD, "Load mode: seconds of arrivals per scheme.", min=1.0)] = 30.0,
    slo_ttft: Annotated[
        float, option(PANEL_LOAD, "Load and trace modes: TTFT objective in seconds (0: not checked).", min=0.0)
    ] = 2.0,
    slo_tbt: Annotated[
        float,
        option(
            PANEL_LOAD,
            "Load and trace modes: objective in seconds for a request's mean time between tokens after the second "
            "(0: not checked).",
            min=0.0,
        ),
    ] = 0.2,
    slo_ttst: Annotated[
        float,
        option(
            PANEL_LOAD,
            "Load and trace modes: time-to-second-token objective in seconds (the stall before decoding; 0: not "
            "checked). Goodput counts a request only if it meets every objective given.",
            min=0.0,
        ),
    ] = 0.0,
    trace: Annotated[
        Path | None,
        option(
            PANEL_TRACE,
            "Trace mode: replay this JSONL trace in the Mooncake FAST'25 format (timestamp ms, input_length, "
            "output_length, hash_ids: one id per 512-token block) against every scheme, each on fresh nodes with "
            "both prefix caches on; equal hash ids give equal prompt blocks, so the caches see the trace's reuse.",
        ),
    ] = None,
    time_scale: Annotated[
        float,
        option(PANEL_TRACE, "Trace mode: arrival times are multiplied by this (0.5 replays twice as fast).", min=1e-6),
    ] = 1.0,
    length_scale: Annotated[
        float,
        option(
            PANEL_TRACE,
            "Trace mode: prompt and output lengths are multiplied by this; a hash id covers round(512 x this) "
            "tokens (the last block keeps its share of a block); outputs keep at least 4 tokens.",
            min=1e-6,
        ),
    ] = 1.0,
    max_requests: Annotated[
        int | None, option(PANEL_TRACE, "Trace mode: replay at most this many requests (after --start).", min=1)
    ] = None,
    start: Annotated[
        int,
        option(
            PANEL_TRACE,
            "Trace mode: skip the trace's first N requests (times then count from the first one replayed).",
            min=0,
        ),
    ] = 0,
    max_input: Annotated[
        int | None,
        option(
            PANEL_TRACE,
            "Trace mode: longest prompt in tokens (after scaling); longer ones are clipped or refused as "
            "--over-length says, and counted. Default: no limit (the nodes are sized for the longest).",
            min=1,
        ),
    ] = None,
    over_length: Annotated[
        str,
        option(
            PANEL_TRACE,
            "Trace mode: a prompt over --max-input is clipped to its first --max-input tokens (clip) or not sent "
            "and counted refused (refuse).",
        ),
    ] = "clip",
    trace_cache_bytes: Annotated[
        str, option(PANEL_TRACE, "Trace mode: each node's prefix cache size (serve --prefix-cache-bytes), e.g. 512M.")
    ] = "1G",
    max_batch: Annotated[
        int | None,
        option(
            PANEL_TRACE,
            "Load and trace modes: the decode node's --max-batch (requests decoding at once; default 8, serve's own; "
            "rounds decode the largest --batch at once).",
            min=1,
        ),
    ] = None,
    slo_from_full: Annotated[
        float | None,
        option(
            PANEL_TRACE,
            "Trace mode: set --slo-ttft and --slo-tbt to this many times full transfer's own unloaded TTFT and TBT "
            "(two requests of the reference length sent alone to full transfer's paced nodes before its replay; "
            "the second is measured), e.g. 2.",
            min=1e-6,
        ),
    ] = None,
    shared_link: Annotated[
        bool,
        option(
            PANEL_WORK,
            "Many prefill nodes into one shared decode link: the decode node's ingress is one paced link at the "
            "regime's rate (serve --ingress-gbps) that every prefill node's bytes cross, as the paper's DP 6 -> 1 "
            "shares the decode machine's NIC; each prefill node also keeps its own --link-gbps at that rate (its own "
            "NIC; with one prefill node the two agree). Without it each prefill node has a link of its own. The "
            "regime line says which applied (the decode node's /status). Rounds, load and trace modes; tcp lane.",
        ),
    ] = False,
    decode_nodes: Annotated[
        int,
        option(
            PANEL_TRACE,
            "Trace mode: this many decode nodes, each on every prefill node, behind SGLang's router (--router); "
            "the placement table reports decode-side prefix hits, bytes moved, TTFT and TTST per policy.",
            min=1,
        ),
    ] = 1,
    router: Annotated[
        str,
        option(
            PANEL_TRACE,
            "Trace mode with --decode-nodes 2+: the router's policies, comma-separated (cache_aware, round_robin, "
            "power_of_two), each replayed on fresh nodes per scheme. The router (sglang-router, its own venv under "
            "~/.cache/smartgen) is installed on first use; where it cannot be, the run stops with the reason.",
        ),
    ] = "",
    router_python: Annotated[
        Path | None,
        option(PANEL_TRACE, "A Python that imports sglang_router, instead of the cached venv (--router)."),
    ] = None,
    lane: Lane = "tcp",
    rdma_device: RdmaDevice = None,
    rdma_port: RdmaPort = None,
    gid_index: GidIndex = None,
    warmup: Annotated[int, option(PANEL_RUN, "Warm-up rounds per point, left out of the stats.", min=0)] = 1,
    reps: Annotated[
        int | None,
        option(
            PANEL_RUN,
            "Measured rounds per point, schemes interleaved; medians and spread are over them (default 3; 1 with "
            "--quick).",
            min=1,
        ),
    ] = None,
    quick: Annotated[
        bool,
        option(
            PANEL_RUN,
            "Small and fast: the defaults of --lengths, --output-tokens, --blocks and --reps drop to 1024, 16, 256 "
            "and 1 (from 2048, 64, 1024 and 3); every scheme still runs (74 s wall time on the sample model on a busy "
            "2-core machine, profiling included; meant to stay under 5 minutes).",
        ),
    ] = False,
    out: Annotated[
        Path | None,
        option(
            PANEL_RUN, "Output folder for results.json, summary.csv and PNG figures (default: bench-results/<time>)."
        ),
    ] = None,
    tasks: Annotated[
        str,
        option(
            PANEL_WORK,
            f"Eval-suite tasks the prompts come from, in turn, comma-separated: {', '.join(TASKS)}. Accuracy is "
            "scored on them, so naming more widens the accuracy check; an answer longer than --output-tokens (vt's: "
            "40 tokens) is scored cut, and the run notes it.",
        ),
    ] = ",".join(DEFAULT_TASKS),
    seed: Annotated[int, option(PANEL_RUN, "Seed of the prompts and random weights.")] = 0,
    db: Db = None,
) -> None:
    """Benchmark the schemes side by side over real prefill and decode processes on a paced loopback link."""
    import time

    from rich.console import Console

    from smartgen.apps.bench import BenchConfig, run_bench
    from smartgen.apps.bench.output import write_outputs
    from smartgen.apps.bench.stats import summarize
    from smartgen.apps.bench.tables import (
        fetch_waits_table,
        latency_table,
        load_table,
        nodes_table,
        placement_table,
        point_tables,
        prefix_table,
        regime_line,
        steps_table,
    )
    from smartgen.store import StoreError

    defaults = QUICK if quick else NORMAL
    rates = numbers(load_rate, "--load-rate", float)
    try:
        trace_spec = _trace_spec(
            trace,
            time_scale,
            length_scale,
            start,
            max_requests,
            max_input,
            over_length,
            trace_cache_bytes,
            slo_from_full,
        )
        if trace_spec is not None and lengths is None:
            from smartgen.apps.bench.trace_run import reference_length

            lengths = str(reference_length(trace_spec.read()))  # the pilot's stall ratio at the median prompt
    except ValueError as exc:
        fail(str(exc))
    lengths = lengths or defaults["lengths"]
    blocks = blocks or defaults["blocks"]
    output_tokens = output_tokens or int(defaults["output_tokens"])
    reps = reps or int(defaults["reps"])
    loaded = bool(rates) or trace is not None
    if strategies == DEFAULT_STRATEGY_OPTION and (loaded or prefix_hit):
        strategies = strategies.replace(",optimal", "")  # no full-transfer run of the same prompt to replay
    try:
        config = BenchConfig(
            model=model,
            schemes=names(schemes),
            strategies=names(strategies),
            selector=selector,
            lane=lane,
            batch=numbers(batch, "--batch", int),
            max_batch=max_batch,
            lengths=numbers(lengths, "--lengths", int),
            stall_ratio=numbers(stall_ratio, "--stall-ratio", float),
            link_gbps=numbers(link_gbps, "--link-gbps", float),
            decode_ratio=parse_decode_ratio(decode_ratio),
            decode_emulation=decode_emulation.strip().lower(),
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
            load_rate=rates,
            load_duration_s=load_duration,
            slo_ttft_s=slo_ttft or None,
            slo_tbt_s=slo_tbt or None,
            slo_ttst_s=slo_ttst or None,
            trace=trace_spec,
            db=db,
            device=device,
            shared_link=shared_link,
            decode_nodes=decode_nodes,
            routers=names(router),
        )
    except ValueError as exc:
        fail(str(exc))
    if config.routers:
        config = replace(config, router_python=_router_python(router_python))
    config = replace(config, lane_flags=lane_flags(lane, rdma_device, rdma_port, gid_index))
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
        tables = (
            [load_table(result, index), latency_table(result, index), nodes_table(result, index)]
            if result.loads
            else point_tables(result, summaries, index)
        )
        if (placement := placement_table(result, index)) is not None:
            tables = [*tables, placement]
        if not result.loads and (steps := steps_table(summaries, index)) is not None:
            tables = [*tables, steps]
        if not result.loads and (waits := fetch_waits_table(summaries, index)) is not None:
            tables = [*tables, waits]
        for table in tables:
            console.print(table)
    if (sweep := prefix_table(result, summaries)) is not None:
        console.print()
        console.print(sweep)
    written = write_outputs(result, summaries, out)
    console.print(f"\nwrote {', '.join(str(p) for p in written)}")
    if not result.loads and not any(p.suffix == ".png" for p in written):
        console.print("no figures: they need matplotlib (pip install 'smartgen\\[plot]')")


def _router_python(given: Path | None) -> Path:
    """The Python SGLang's router runs under: `given` (checked), else the cached venv's, installed on first use;
    exits 2 with the reason where it cannot be had."""
    from smartgen.apps.router import RouterUnavailable, ensure_router, router_importable

    if given is not None:
        if not router_importable(given):
            fail(f"--router-python {given} cannot import sglang_router (pip install sglang-router there)")
        return given
    try:
        return ensure_router(say=lambda line: print(line, file=sys.stderr))
    except RouterUnavailable as exc:
        fail(f"--router needs SGLang's router: {exc}")


def _trace_spec(
    trace: Path | None,
    time_scale: float,
    length_scale: float,
    start: int,
    max_requests: int | None,
    max_input: int | None,
    over_length: str,
    cache_bytes: str,
    slo_from_full: float | None,
) -> TraceSpec | None:
    """Trace mode's settings, or None without --trace (then its options must be left at their defaults)."""
    from smartgen.apps.bench.config import TraceSpec

    if trace is None:
        if slo_from_full is not None:
            raise ValueError("--slo-from-full derives the SLOs in trace mode: give --trace too")
        return None
    return TraceSpec(
        path=trace,
        time_scale=time_scale,
        length_scale=length_scale,
        start=start,
        max_requests=max_requests,
        max_input=max_input,
        over_length=over_length,
        cache_bytes=parse_size(cache_bytes, "--trace-cache-bytes"),
        slo_from_full=slo_from_full,
    )


@contextmanager
def phase_bar(console: Console) -> Iterator[tuple[Progress, Callable[[str, int, int | None], None]]]:
    """A transient bar for run_bench's phases and the `progress(what, done, total)` that drives it.

    A new phase (done drops, or the total changes) gets a task of its own, so its elapsed time and ETA are the
    phase's rather than an average over the pilot and the rounds; a phase without a total (loading and profiling
    the model) shows a spinner and its description, and "?" for the count.
    """

    with progress_bar(console) as bar:
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
