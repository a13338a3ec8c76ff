"""`smartgen cluster`: prefill and decode nodes (xPyD) and SGLang's router in front, on this machine, until Ctrl-C.

Only the options and the table are here: `smartgen.apps.scale_out.ScaleOut` runs the cluster.
"""

from __future__ import annotations

import enum
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from smartgen.sysinfo import SAMPLES_DIR

from .errors import fail
from .options import Blocks, Budget, Device, LinkGbps, ModelFolder, Selector, option
from .serve import PrefixCacheBytes
from .sizes import parse_size
from .store_options import Db

if TYPE_CHECKING:  # rich and the cluster load only when the command runs, so --help stays fast
    from rich.table import Table

    from smartgen.apps.cluster_state import NodeState

NODES, ROUTER = "Nodes", "Router"
DEFAULT_MODEL = SAMPLES_DIR / "sample-model-16"


class RouterKind(str, enum.Enum):
    sglang = "sglang"
    none = "none"


class Policy(str, enum.Enum):  # smartgen.apps.router.POLICIES (not imported: --help stays fast)
    cache_aware = "cache_aware"
    round_robin = "round_robin"
    power_of_two = "power_of_two"


def cluster(
    prefill: Annotated[int, option(NODES, "Prefill nodes to start.", min=1, max=16)] = 1,
    decode: Annotated[
        int, option(NODES, "Decode nodes to start; each uses every prefill node (xPyD).", min=1, max=16)
    ] = 2,
    model: ModelFolder = DEFAULT_MODEL,
    device: Device = "cpu",
    link_gbps: LinkGbps = 0.0,
    selector: Selector = "quest",
    budget: Budget = 0.2,
    blocks: Blocks = 1024,
    prefix_cache_bytes: PrefixCacheBytes = "1G",
    max_batch: Annotated[int, option(NODES, "Requests each decode node decodes together.", min=1)] = 8,
    max_tokens: Annotated[
        int, option(NODES, "Prompt + output tokens a decode node's pool slot holds (the longest request).", min=16)
    ] = 8192,
    db: Db = None,
    router: Annotated[
        RouterKind,
        option(
            ROUTER,
            "sglang: SGLang's router (regular mode) in front of the decode nodes, the one URL to use; none: no "
            "router, the decode nodes' URLs are printed and clients pick one.",
        ),
    ] = RouterKind.sglang,
    policy: Annotated[
        Policy,
        option(
            ROUTER,
            "The router's policy: cache_aware (a request goes where the longest prefix of its text went before, so "
            "prefix caches pay off), round_robin, or power_of_two (the less loaded of two nodes).",
        ),
    ] = Policy.cache_aware,
    host: Annotated[str, option(ROUTER, "Address the router listens on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, option(ROUTER, "The router's port (0: a free one).", min=0, max=65535)] = 30000,
    router_python: Annotated[
        Path | None,
        option(
            ROUTER,
            "A Python that has sglang-router installed (`python -c 'import sglang_router'` works); default: the venv "
            "smartgen keeps under ~/.cache/smartgen/, made on first use.",
        ),
    ] = None,
    install: Annotated[
        bool,
        option(ROUTER, "Install sglang-router into smartgen's venv when it is missing (pip; needs a package index)."),
    ] = True,
    run_dir: Annotated[
        Path | None,
        option(
            NODES,
            "Folder for the nodes' logs, ready files and cluster.json (kept after the run); default: a temporary "
            "one, removed at exit.",
        ),
    ] = None,
    interval: Annotated[float, option(NODES, "Seconds between refreshes of the node table.", min=0.1)] = 1.0,
) -> None:
    """Start prefill and decode nodes and SGLang's router on this machine; print the URL to use; stop all on Ctrl-C.

    Every decode node uses every prefill node (xPyD). The router is installed into a venv of its own on first use.

    The table shows each process as ready, not ready (a decode node without a live prefill node) or lost (exited).

    Ctrl-C or SIGTERM stops the router, then the nodes: none is left behind.
    """
    from smartgen.apps.cluster import ClusterSpec
    from smartgen.apps.router import RouterUnavailable, ensure_router, router_importable
    from smartgen.apps.scale_out import PortTaken, RouterSpec, ScaleOut

    if not (model / "config.json").exists():
        fail(f"no model at {model} (a folder with config.json; the sample model lives in samples/sample-model-16)")
    cache = str(parse_size(prefix_cache_bytes, "--prefix-cache-bytes", minimum=0))
    router_spec = None
    if router is RouterKind.sglang:
        if router_python is not None and not router_importable(router_python):
            fail(f"--router-python {router_python} cannot import sglang_router (pip install sglang-router there)")
        try:
            python = router_python or ensure_router(install, say=lambda line: typer.echo(line, err=True))
        except RouterUnavailable as exc:
            fail(str(exc), code=1)
        router_spec = RouterSpec(python, policy.value, host, port)
    spec = ClusterSpec(
        model=model,
        link_gbps=link_gbps or None,
        blocks=blocks,
        selector=selector,
        budget=budget,
        prefill_nodes=prefill,
        decode_nodes=decode,
        max_batch=max_batch,
        max_tokens=max_tokens,
        db=db,
        prefill_cache=cache,
        decode_cache=cache,
        device=device,
    )
    # SIGTERM stops the cluster as Ctrl-C does; SIGINT is set too, since a shell script's `smartgen cluster &`
    # starts with it ignored, and `kill -INT` must still stop everything
    stop = StopSignal()
    handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    what = f"{prefill} prefill and {decode} decode node{'s' * (decode > 1)} ({model.name})"
    typer.echo(f"starting {what}" + (f", then SGLang's router ({policy.value})" if router_spec else ""))
    started = time.monotonic()
    try:
        with ScaleOut(spec, router_spec, run_dir) as running:
            stop.check()  # a signal while the nodes started
            _serve(running, time.monotonic() - started, interval, stop.check)
    except KeyboardInterrupt:
        pass
    except PortTaken as exc:
        fail(str(exc))
    except (RuntimeError, TimeoutError) as exc:
        fail(str(exc), code=1)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    typer.echo("stopped: every node" + (" and the router" if router_spec else ""))


class StopSignal:
    """The handler of SIGINT and SIGTERM: KeyboardInterrupt at once, and a flag that `check` turns into one later.
    Python drops an exception a handler raises while a fork's hooks run (subprocess.Popen, as a node starts: "Exception
    ignored in _releaseLock"), which once left a cluster serving on after SIGTERM."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum: int, frame: object) -> None:
        self.requested = True
        raise KeyboardInterrupt

    def check(self) -> None:
        """KeyboardInterrupt if a stop signal came, whether or not its own exception got through."""
        if self.requested:
            raise KeyboardInterrupt


def _serve(running: Any, took: float, interval: float, check: Callable[[], None] = lambda: None) -> None:
    """Prints where to go, then the node table until Ctrl-C (KeyboardInterrupt, or `check` raising one): live in a
    terminal, else one line per change of a node's state."""
    from rich.console import Console
    from rich.live import Live

    console = Console()
    if not console.is_terminal:  # a log file: rows on one line each, so a line says all of a node
        console = Console(width=160)
    if running.router_url:
        typer.echo(f"ready in {took:.1f} s: use {running.url}/v1 (OpenAI API, through the router)")
    else:
        urls = " ".join(running.cluster.urls)
        typer.echo(f"ready in {took:.1f} s: no router; decode nodes at {urls} (each /v1)")
    typer.echo(f"run folder: {running.run_dir} (logs; watch: smartgen monitor --cluster {running.run_dir})")
    states = running.watch()
    if console.is_terminal:
        typer.echo("Ctrl-C stops everything")
        with Live(_table(states), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                check()
                live.update(_table(running.watch()), refresh=True)
    console.print(_table(states))
    typer.echo("Ctrl-C stops everything")  # the last line of the start, after the table (a reader waits for it)
    seen = {row.name: _shown(row) for row in states}
    while True:
        time.sleep(interval)
        check()
        for row in running.watch():
            if seen.get(row.name) != _shown(row):
                typer.echo(f"{time.strftime('%H:%M:%S')} {row.name} {row.state}: {row.detail}")
                seen[row.name] = _shown(row)


def _shown(row: NodeState) -> tuple[str, str]:
    """What a change is printed for: the state, and the links a decode node or the router sees (a prefill node's
    detail counts requests, which change all the time)."""
    return row.state, "" if row.role == "prefill" else row.detail


_STYLES = {"ready": "green", "not ready": "yellow", "no answer": "yellow", "lost": "bold red"}


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def _table(states: list[NodeState]) -> Table:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=time.strftime("%H:%M:%S"), title_justify="left")
    for column in ("node", "address", "state", "running", "waiting", "detail"):
        table.add_column(
            column, justify="right" if column in ("running", "waiting") else "left", no_wrap=column != "detail"
        )
    for row in states:
        state = Text(row.state, style=_STYLES.get(row.state, ""))
        cells = (row.name, row.url.removeprefix("http://"), state, _count(row.running), _count(row.waiting), row.detail)
        table.add_row(*(c if isinstance(c, Text) else Text(c) for c in cells))  # a detail may hold brackets
    return table
