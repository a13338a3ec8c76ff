"""The `--db` option and opening the profile store, shared by every command that reads or writes profiles."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from .errors import fail

if TYPE_CHECKING:
    from smartgen.store import ProfileStore

__all__ = ["STORE", "Db", "open_store"]

STORE = "Store"
Db = Annotated[
    Path | None,
    typer.Option(
        "--db",
        help="Profile database file (default: $SMARTGEN_DB, else $XDG_DATA_HOME/smartgen/profiles.db).",
        rich_help_panel=STORE,
    ),
]


def open_store(db: Path | None, *, create: bool) -> ProfileStore:
    """The store at --db, $SMARTGEN_DB or the XDG default (whose folder is created on first use); fails in one line."""
    from smartgen.store import ProfileStore, StoreError

    try:
        return ProfileStore(db, create=create)
    except StoreError as exc:
        fail(str(exc))
