"""One way for every command to fail on a user mistake: a one-line message and a non-zero exit, no traceback.

Commands import `fail` relatively (`from .errors import fail`): mypy checks this folder as the package `cli`,
where `smartgen.cli` does not resolve, and only a resolved `fail` is known to be NoReturn.
"""

from __future__ import annotations

from typing import NoReturn

import typer


def fail(message: str, code: int = 2) -> NoReturn:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code)
