"""Byte sizes on the command line (`--prefix-cache-bytes 512M`): plain bytes or a K/M/G/T suffix (powers of 1024)."""

from __future__ import annotations

import re

from .errors import fail

__all__ = ["byte_size"]

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def byte_size(text: str, option: str) -> int:
    """`text` as a number of bytes ("0", "4096", "512M", "1.5G", "2GiB"); a one-line error naming `option`."""
    match = _SIZE.match(text)
    if match is None:
        fail(f"{option} takes a size in bytes, optionally with K, M, G or T (powers of 1024), got {text!r}")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit.upper()])
