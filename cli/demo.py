"""`smartgen demo`: a prefill node and a decode node over a paced loopback link, full transfer vs SmartGen side by side."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any

import typer

from smartgen.sysinfo import SAMPLES_DIR

from .errors import fail
from .lane_options import GidIndex, Lane, RdmaDevice, RdmaPort, SeparateCpus, lane_flags
from .lists import names
from .options import Blocks, Budget, Calibration, DecodeRatio, ModelFolder, Selector, StallRatio, parse_decode_ratio
from .progress import progress_bar
from .simulate import folding_table
from .store_options import Db

if TYPE_CHECKING:  # rich and the demo load only when the command runs, so --help stays fast
    from rich.console import Console
    from rich.table import Table

    from smartgen.apps.demo import SchemeResult

DEFAULT_MODEL = SAMPLES_DIR / "sample-model-16"  # 16 layers: layers 0-1 an eighth of the KV, as in deep models
PAPER_STALL_RATIO = 4.7  # smartgen.apps.bench.config.PAPER_STALL_RATIO (here: --help imports no torch)
PAPER_DECODE_RATIO = 0.15  # smartgen.apps.demo.PAPER_DECODE_RATIO, likewise


def demo(
    model: ModelFolder = DEFAULT_MODEL,
    db: Db = None,
    calibration: Calibration = None,
    schemes: Annotated[
        str,
        typer.Option(help="Schemes to compare, comma-separated (full, partial, partial+profile+parallel, smartgen)."),
    ] = "full,partial,smartgen",
    length: Annotated[int, typer.Option(min=256, help="Prompt length in tokens.")] = 2048,
    per_task: Annotated[int, typer.Option(min=1, help="Prompts per task (passkey and single-needle retrieval).")] = 2,
    selector: Selector = "quest",
    budget: Budget = 0.2,
    blocks: Blocks = 1024,
    stall_ratio: StallRatio = PAPER_STALL_RATIO,
    decode_ratio: DecodeRatio = f"{PAPER_DECODE_RATIO:g}",
    lane: Lane = "tcp",
    separate_cpus: SeparateCpus = True,
    rdma_device: RdmaDevice = None,
    rdma_port: RdmaPort = None,
    gid_index: GidIndex = None,
    monitor: Annotated[
        bool,
        typer.Option(
            "--monitor",
            help="Watch the run in the dashboard: in this terminal when it is interactive (press q when done to see "
            "the results), else print the `smartgen monitor` command to run in another terminal.",
        ),
    ] = False,
) -> None:
    """Run the main job: two real nodes over a paced loopback link, schemes side by side (a few minutes).

    A model with no profile in --db is profiled there first, over --calibration.
    """
    from rich.console import Console
    from rich.text import Text

    from smartgen.apps.demo import DemoConfig, run_demo
    from smartgen.engine.policy import check_servable, get_policy
    from smartgen.store import StoreError

    if not (model / "config.json").exists():
        fail(f"no model at {model} (the sample model lives in samples/sample-model)")
    flags = lane_flags(lane, rdma_device, rdma_port, gid_index)
    if not names(schemes):
        fail("--schemes is empty")
    target_ratio = parse_decode_ratio(decode_ratio)
    try:
        for scheme in names(schemes):  # before the model loads and the nodes start
            check_servable(get_policy(scheme))
    except ValueError as exc:
        fail(str(exc))
    console = Console()
    config = DemoConfig(
        model=model,
        db=db,
        calibration=calibration,
        schemes=names(schemes),
        length=length,
        per_task=per_task,
        selector=selector,
        blocks=blocks,
        budget=budget,
        transfer_ratio=stall_ratio,
        decode_ratio=target_ratio,
        lane=lane,
        lane_flags=flags,
        separate_cpus=separate_cpus,
    )
    say = lambda line: console.print(Text(line, style="dim"))  # noqa: E731  (Text: a line is not markup)
    try:
        if monitor and sys.stdin.isatty() and sys.stdout.isatty():
            results, setup = _run_beside_dashboard(config, say)
        else:
            if monitor:
                config.on_nodes = lambda decode, prefill: console.print(
                    f"watch it from another terminal: [bold]{_monitor_command(decode, prefill)}[/]"
                )
            with request_bar(console) as progress:
                results, setup = run_demo(config, say=say, progress=progress)
    except (RuntimeError, ValueError, OSError, StoreError) as exc:
        fail(str(exc), code=1)
    console.print(results_table(results, setup))


def results_table(results: list[SchemeResult], setup: dict[str, Any]) -> Table:
    """The demo's results, one row per scheme; last token: when the answer's last token came (its mean over the
    requests); TTST vs first: the first scheme's TTST over this one's."""
    table = folding_table(
        f"{setup['model']}, {setup['prompt_tokens']} prompt tokens, {setup['selector']}, link "
        f"{setup['link_gbps'] * 1000:.1f} Mbit/s (full transfer {setup['transfer_s']:.2f} s, prefill "
        f"{setup['prefill_s']:.2f} s), stall ratio {setup['regime'].stall_ratio:.2f}, decode-side ratio "
        f"{setup['regime'].decode_ratio:.3f}"
        + (f" (+{setup['regime'].emulate_layer_ms:.2f} ms/layer emulated)" if setup["regime"].emulate_layer_ms else ""),
        ["scheme", "TTFT ms", "TTST ms", "mean TBT ms", "last token ms", "answers correct", "TTST vs first"],
    )
    from rich.text import Text

    first = results[0].mean("ttst") if results else None

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.0f}"

    for r in results:
        ttst = r.mean("ttst")
        correct = f"{sum(r.scores):.0f}/{len(r.scores)}" + (f" ({len(r.errors)} failed)" if r.errors else "")
        table.add_row(
            Text(r.scheme),  # Text: "smartgen[random]" is not markup
            ms(r.mean("ttft")),
            ms(ttst),
            ms(r.mean("tbt")),
            ms(r.mean("last")),
            correct,
            "-" if not (first and ttst) else f"{first / ttst:.2f}x",
        )
    return table


@contextmanager
def request_bar(console: Console) -> Iterator[Callable[[str, int, int], None]]:
    """A transient bar with ETA over the demo's requests, and the `progress(what, done, total)` that drives it;
    off when the console is not a terminal (piped, CI), where a bar would only add control codes."""

    with progress_bar(console, disable=not console.is_terminal) as bar:
        task = None

        def progress(what: str, done: int, total: int) -> None:
            nonlocal task
            if task is None:  # opened by the first request, so the ETA leaves out profiling, pilot and node starts
                task = bar.add_task(what, total=total)
            bar.update(task, description=what, completed=done)

        yield progress


def _monitor_command(decode: str, prefill: list[str]) -> str:
    return " ".join(["smartgen monitor dashboard --decode", decode, *(f"--prefill {url}" for url in prefill)])


def _run_beside_dashboard(config: Any, say: Callable[[str], None]) -> tuple[list, dict]:
    """The demo in a thread and the dashboard in this terminal; the nodes stay up until the dashboard quits."""
    from smartgen.apps.demo import run_demo
    from smartgen.tui.app import DashboardApp
    from smartgen.tui.feed import HttpFeed

    nodes: dict[str, Any] = {}
    ready, quit_ = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}
    held: list[str] = []  # log lines while the dashboard owns the terminal, printed after it

    def on_nodes(decode: str, prefill: list[str]) -> None:
        nodes.update(decode=decode, prefill=prefill)
        ready.set()

    def work() -> None:
        try:
            outcome["result"] = run_demo(config, say=lambda line: held.append(line) if ready.is_set() else say(line))
        except BaseException as exc:  # re-raised in the caller's thread
            outcome["error"] = exc
        finally:
            ready.set()

    config.on_nodes, config.before_stop = on_nodes, quit_.wait
    thread = threading.Thread(target=work, name="demo", daemon=True)
    thread.start()
    ready.wait()
    if nodes:
        DashboardApp(HttpFeed(nodes["decode"], nodes["prefill"]), interval=0.5).run()
    quit_.set()
    if thread.is_alive():
        say("dashboard closed; the demo goes on")
    thread.join()
    for line in held:
        say(line)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
