"""Comma-separated option values (`--schemes a,b`, `--batch 1,2,4`), parsed one way for every command."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from .errors import fail

__all__ = ["names", "numbers"]

T = TypeVar("T", int, float)


def names(text: str) -> tuple[str, ...]:
    """The non-empty, stripped items of a comma-separated list."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def numbers(text: str, option: str, kind: Callable[[str], T]) -> tuple[T, ...]:
    """The items as `kind` (int or float); a one-line error naming `option` for anything else."""
    try:
        return tuple(kind(part) for part in names(text))
    except ValueError:
        what = "whole numbers" if kind is int else "numbers"
        fail(f"{option} takes comma-separated {what}, got {text!r}")
