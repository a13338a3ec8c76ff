"""Byte sizes on the command line (`--max-store-bytes 8G`, `--prefix-cache-bytes 0`): parsed one way, with a one-line error."""

from __future__ import annotations

import os
import re

from .errors import fail

__all__ = ["parse_size", "half_of_memory"]

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)


def parse_size(text: str, option: str, minimum: int = 1) -> int:
    """'1073741824', '512M', '8G', '1.5GiB' -> bytes (powers of 1024); a one-line error naming `option` otherwise
    (and below `minimum`: 0 where 0 turns something off)."""
    match = _SIZE.match(text)
    if match is None:
        fail(f"{option} takes a byte size such as 1073741824, 512M or 8G, got {text!r}")
    size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if size < minimum:
        fail(f"{option} must be at least {minimum} byte{'s' * (minimum != 1)}, got {text!r}")
    return size


def half_of_memory() -> int:
    """Half of this machine's physical memory (the prefill store's default cap), or 16 GiB where unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):  # not every platform names these
        return 16 * 2**30
