"""`smartgen profiles …`: list, show, remove, export, import and compare the calibration profiles in the store."""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from .errors import fail
from .store_options import Db, open_store

if TYPE_CHECKING:
    from smartgen.store import ProfileStore

app = typer.Typer(
    help="List, show, remove, export, import and compare stored calibration profiles.",
    no_args_is_help=True,
)

IdArgument = Annotated[
    int, typer.Argument(help="Profile id, as `smartgen profiles list` shows it.", show_default=False)
]
FRACTIONS = (0.05, 0.1, 0.25)  # compare also at these shares of the blocks beyond layers 0-1


class ExportFormat(str, Enum):
    json = "json"


def _get(store: ProfileStore, profile_id: int):
    from smartgen.store import StoreError

    try:
        return store.get(profile_id)
    except StoreError as exc:
        fail(str(exc))


@app.command("list")
def list_profiles(
    db: Db = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the profiles' fields as JSON (no importance matrices).")
    ] = False,
) -> None:
    """List the stored profiles, oldest first."""
    from rich.console import Console
    from rich.table import Table

    from smartgen.cli.profile import duration
    from smartgen.store import StoreError
    from smartgen.store.profile import short
    from smartgen.sysinfo import default_db_path

    path = db if db is not None else default_db_path()
    if not path.exists():  # a first run: nothing stored yet is not an error
        if as_json:
            typer.echo("[]")
        else:
            typer.echo(f"no profiles yet; `smartgen profile` stores them in {path}")
        return
    with open_store(db, create=False) as store:
        try:
            profiles = store.list()
        except StoreError as exc:
            fail(str(exc))
    if as_json:
        typer.echo(json.dumps([p.summary() for p in profiles], indent=2))
        return
    if not profiles:
        typer.echo(f"no profiles in {store.path}")
        return
    table = Table(title=f"profiles in {store.path}", title_justify="left")
    for column in ("id", "model", "fingerprint", "selector", "M", "lengths", "prompts", "T_p", "T_t", "K_r"):
        table.add_column(
            column,
            justify="right" if column in ("id", "M", "prompts", "T_p", "T_t", "K_r") else "left",
            no_wrap=column in ("fingerprint", "lengths", "T_p", "T_t"),
        )
    for p in profiles:
        params = " ".join(f"{k}={v}" for k, v in p.selector_params.items())
        table.add_row(
            str(p.id),
            Path(p.model).name or p.model,
            short(p.model_fingerprint),
            f"{p.selector} {params}".strip(),
            str(p.num_blocks),
            f"{p.length_lo}-{p.length_hi}",
            str(p.num_prompts),
            duration(p.prefill_seconds),
            duration(p.transfer_seconds),
            str(p.k_r()),
        )
    Console().print(table)


@app.command("show")
def show(
    profile_id: IdArgument,
    db: Db = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the fields as JSON instead of the heat map.")] = False,
) -> None:
    """Show one profile: its fields, its importance heat map and K_r at a few link rates."""
    from rich.console import Console
    from rich.table import Table

    from smartgen.cli.profile import render_profile

    with open_store(db, create=False) as store:
        item = _get(store, profile_id)
    if as_json:
        typer.echo(json.dumps(item.summary(), indent=2))
        return
    console = Console()
    table = Table(show_header=False)
    for key, value in item.summary().items():
        table.add_row(key, json.dumps(value) if isinstance(value, dict) else str(value))
    console.print(table)
    render_profile(console, item)


@app.command("rm")
def remove(profile_id: IdArgument, db: Db = None) -> None:
    """Remove a profile from the store."""
    from smartgen.store import StoreError

    with open_store(db, create=False) as store:
        try:
            store.remove(profile_id)
        except StoreError as exc:
            fail(str(exc))
    typer.echo(f"removed profile {profile_id}")


@app.command("export")
def export(
    profile_id: IdArgument,
    db: Db = None,
    fmt: Annotated[
        ExportFormat,
        typer.Option("--format", help="Output format (the importance matrix keeps its exact float32 bytes)."),
    ] = ExportFormat.json,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write to this file instead of standard output.")
    ] = None,
) -> None:
    """Export a profile (fields and importance matrix) for `smartgen profiles import` elsewhere."""
    with open_store(db, create=False) as store:
        data = _get(store, profile_id).to_dict()
    text = json.dumps(data, indent=2) + "\n"
    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        output.write_text(text)
    except OSError as exc:
        fail(f"cannot write {output}: {exc.strerror or exc}")
    typer.echo(f"exported profile {profile_id} to {output}")


@app.command("import")
def import_profile(
    file: Annotated[
        Path,
        typer.Argument(
            help="A file written by `smartgen profiles export` ('-' reads standard input).", show_default=False
        ),
    ],
    db: Db = None,
) -> None:
    """Import an exported profile; it gets a new id."""
    from smartgen.store import StoreError

    try:
        text = sys.stdin.read() if str(file) == "-" else file.read_text()
    except OSError as exc:
        fail(f"cannot read {file}: {exc.strerror or exc}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        fail(f"{file} is not JSON ({exc.msg} at line {exc.lineno})")
    with open_store(db, create=True) as store:
        try:
            new_id = store.import_(data)
        except StoreError as exc:
            fail(f"cannot import {file}: {exc}")
    typer.echo(f"imported profile {new_id}")


@app.command("compare")
def compare_profiles(
    first: IdArgument,
    second: Annotated[int, typer.Argument(help="Id of the profile to compare it with.", show_default=False)],
    db: Db = None,
    k_r: Annotated[
        int | None,
        typer.Option(
            "--k-r", min=1, help="Compare at this K_r (blocks, layers 0-1 included) instead of each profile's own."
        ),
    ] = None,
) -> None:
    """Overlap of two profiles' top-K_r block sets (recall and Jaccard): the positional-similarity check."""
    from rich.console import Console
    from rich.table import Table

    from smartgen.engine.layout import DENSE_LAYERS
    from smartgen.store import compare

    with open_store(db, create=False) as store:
        a, b = _get(store, first), _get(store, second)
    budgets: list[tuple[str, int | None]] = [("given", k_r)] if k_r is not None else [("each profile's own", None)]
    if k_r is None:
        floor = DENSE_LAYERS * a.num_blocks
        sparse = (a.num_layers - DENSE_LAYERS) * a.num_blocks
        budgets += [(f"{f:.0%} of layers >= 2", floor + max(1, round(f * sparse))) for f in FRACTIONS]
    table = Table(title=f"top-K_r overlap of profile {first} (A) and {second} (B)", title_justify="left")
    for column in ("K_r", "K_r A", "K_r B", "|A|", "|B|", "|A ∩ B|", "recall (B by A)", "Jaccard"):
        table.add_column(column, justify="left" if column == "K_r" else "right")
    notes = []
    for label, budget in budgets:
        try:
            overlap = compare(a, b, budget)
        except ValueError as exc:
            fail(str(exc))
        if overlap.empty:
            notes.append(f"{label}: K_r is at its floor (layers 0-1 only), nothing to compare; pass --k-r")
        if overlap.covers_all:
            notes.append(f"{label}: K_r covers every block, so the overlap is 1 whatever the profiles say; pass --k-r")
        table.add_row(
            label,
            str(overlap.k_r_a),
            str(overlap.k_r_b),
            str(overlap.num_a),
            str(overlap.num_b),
            str(overlap.num_common),
            f"{overlap.recall:.3f}",
            f"{overlap.jaccard:.3f}",
        )
    console = Console()
    console.print(table)
    for note in notes:
        console.print(f"[yellow]note[/]: {note}")
