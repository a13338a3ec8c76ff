"""The `smartgen` command line: the root typer app, its global options, and the registry of commands."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

import smartgen
from smartgen.cli import bench, cluster, demo, generate, info, monitor, profile, profiles, serve, simulate
from smartgen.cli.eval import eval_command
from smartgen.cli.options import new_name

app = typer.Typer(
    name="smartgen",
    help="SmartGen: KV-cache transfer engine for disaggregated LLM inference.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    context_settings={"token_normalize_func": new_name},  # old option names still work, and say the new one
)

_LEVELS = (logging.WARNING, logging.INFO, logging.DEBUG)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"smartgen {smartgen.__version__}")
        raise typer.Exit()


@app.callback()
def root(
    verbose: Annotated[
        int,
        typer.Option("--verbose", "-v", count=True, help="More log output: -v for INFO, -vv for DEBUG."),
    ] = 0,
    version: Annotated[
        bool | None,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the smartgen version and exit."),
    ] = None,
) -> None:
    """SmartGen: KV-cache transfer engine for disaggregated LLM inference."""
    if verbose:  # left alone otherwise, so embedding callers (and tests) keep their own logging set-up
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("smartgen").setLevel(_LEVELS[min(verbose, len(_LEVELS) - 1)])


# Commands live in their own modules; register each here (sub-apps per noun via app.add_typer).
app.command("info", rich_help_panel="Inspect")(info.info)
app.command("simulate", rich_help_panel="Benchmark")(simulate.simulate)
app.command("profile", rich_help_panel="Profile")(profile.profile)
app.add_typer(profiles.app, name="profiles", rich_help_panel="Profile")
app.command("serve", rich_help_panel="Serve")(serve.serve)
app.command("demo", rich_help_panel="Serve")(demo.demo)
app.command("generate", rich_help_panel="Serve")(generate.generate)
app.command("cluster", rich_help_panel="Serve")(cluster.cluster)
app.command("monitor", rich_help_panel="Serve")(monitor.monitor)
app.command("eval", rich_help_panel="Benchmark")(eval_command)
app.command("bench", rich_help_panel="Benchmark")(bench.bench)


def main() -> None:
    """Console-script entry point (`smartgen`, `python -m smartgen`)."""
    app()
