"""What a prefix cache reports as it changes: blocks stored, blocks removed, everything cleared (vLLM's three KV events)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["BlocksStored", "BlocksRemoved", "AllCleared", "CacheEvent", "CacheListener"]


@dataclass(slots=True)
class BlocksStored:
    """Consecutive blocks of one prompt, each the child of the one before; the first the child of `parent`."""

    keys: list[bytes]
    parent: bytes | None
    token_ids: list[int] = field(repr=False)  # len(keys) · block_size tokens
    block_size: int
    medium: str  # where the KV lives: "CPU" or "GPU"


@dataclass(slots=True)
class BlocksRemoved:
    keys: list[bytes]
    medium: str


@dataclass(slots=True)
class AllCleared:
    pass


CacheEvent = BlocksStored | BlocksRemoved | AllCleared
# called with one operation's events, in order, while the cache is locked: must return at once (queue, never send)
CacheListener = Callable[[list[CacheEvent]], None]
