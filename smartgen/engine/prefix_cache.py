"""A KV prefix cache keyed by chained hashes of token blocks, under a byte budget, evicting by a retention policy.

Both roles keep one: the prefill node to skip prefill of a cached prefix, the decode node to
skip transferring KV it already holds. A block of `block_tokens` tokens is keyed by a hash of
its tokens chained with the hash of the block before it, so a key names the whole prefix up to
and including its block, and a prompt's cached part is the longest leading run of keys found.

A hit pins its blocks until `release`: a block in use is never evicted. Only leaves are evicted (a
block none of whose children is cached), so eviction takes a prefix's tail before its head (a head
evicted would strand every block after it). Which leaf goes is the retention policy's choice
(`smartgen.engine.retention`: LRU by default, or cost-aware). A listener, when set, hears every
block stored and removed (`smartgen.engine.cache_events`), as KV events publish them.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from smartgen.engine.cache_events import BlocksRemoved, BlocksStored, CacheEvent, CacheListener
from smartgen.engine.retention import LruRetention, Retention

__all__ = ["DEFAULT_BLOCK_TOKENS", "block_hashes", "PrefixHit", "PrefixCache", "PrefixCacheStats"]

DEFAULT_BLOCK_TOKENS = 16


def block_hashes(token_ids: torch.Tensor | list[int], block_tokens: int, salt: str = "") -> list[bytes]:
    """Chained keys of each whole block of `token_ids`: key i covers tokens [0, (i + 1) · block_tokens)."""
    ids = torch.as_tensor(token_ids, dtype=torch.int64).flatten().cpu()
    keys = []
    previous = hashlib.blake2b(salt.encode(), digest_size=16).digest()
    data, step = memoryview(ids.numpy().tobytes()), block_tokens * 8  # one copy, then slices of it
    for start in range(0, (ids.numel() // block_tokens) * step, step):
        previous = hashlib.blake2b(previous + data[start : start + step], digest_size=16).digest()
        keys.append(previous)
    return keys


@dataclass(slots=True)
class _Block:
    k: torch.Tensor  # [L, B, H, d]
    v: torch.Tensor
    parent: bytes | None = None  # the key of the block before it (None: the prompt's first)
    pins: int = 0
    children: int = 0  # cached blocks whose parent this is: while any, it is not evicted

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


@dataclass(slots=True)
class PrefixHit:
    """The cached leading blocks of one prompt, pinned until `PrefixCache.release`."""

    keys: list[bytes]
    blocks: list[_Block] = field(repr=False)
    tokens: int  # usable cached tokens (may stop inside the last block)

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the hit's tokens, [L, tokens, H, d] each (a copy)."""
        k = torch.cat([block.k for block in self.blocks], dim=1)[:, : self.tokens]
        v = torch.cat([block.v for block in self.blocks], dim=1)[:, : self.tokens]
        return k, v


@dataclass(slots=True)
class PrefixCacheStats:
    lookups: int = 0
    lookup_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of those, found cached
    hits: int = 0  # lookups that found at least one block
    inserted_blocks: int = 0
    evicted_blocks: int = 0
    refused_blocks: int = 0  # not inserted: the budget was held by pinned blocks
    declined_blocks: int = 0  # not inserted: the retention policy judged them worth less than what they would evict


class PrefixCache:
    """Token-block KV under `budget_bytes` (0 turns it off: nothing is kept, nothing found)."""

    def __init__(
        self,
        budget_bytes: int,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        salt: str = "",
        retention: Retention | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`retention`: which block leaves when room is needed (None: LRU); `clock`: seconds, for the policy's ages
        (a trace replay passes the trace's own)."""
        if budget_bytes < 0:
            raise ValueError("a prefix cache budget cannot be negative")
        if block_tokens < 1:
            raise ValueError("a prefix cache block holds at least one token")
        self.budget_bytes = budget_bytes
        self.block_tokens = block_tokens
        self.salt = salt
        self.stats = PrefixCacheStats()
        self.retention = retention or LruRetention()
        self.clock = clock
        self.listener: CacheListener | None = None  # hears stored and removed blocks (`set_listener`)
        self._blocks: dict[bytes, _Block] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def set_listener(self, listener: CacheListener | None) -> None:
        """From now on `listener` hears every change (None: nobody); blocks already held are not announced."""
        with self._lock:
            self.listener = listener

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def keys(self, token_ids: torch.Tensor | list[int]) -> list[bytes]:
        return block_hashes(token_ids, self.block_tokens, self.salt)

    def match(self, token_ids: torch.Tensor | list[int], max_tokens: int | None = None) -> PrefixHit | None:
        """Pins and returns the longest cached leading run of the prompt's blocks, at most `max_tokens` tokens
        (a prefill must compute at least one token); None when nothing is cached."""
        length = len(token_ids)
        limit = length if max_tokens is None else min(max_tokens, length)
        if not self.enabled:
            return None
        keys = self.keys(token_ids)
        with self._lock:
            self.stats.lookups += 1
            self.stats.lookup_tokens += length
            found: list[bytes] = []
            for key in keys:
                if key not in self._blocks or len(found) * self.block_tokens >= limit:
                    break
                found.append(key)
            tokens = min(len(found) * self.block_tokens, limit)
            if tokens <= 0:
                return None
            blocks = [self._blocks[key] for key in found]
            now = self.clock()
            for key in reversed(found):  # the head ends most recent: the tail is evicted first
                self.retention.hit(key, now)
            for block in blocks:
                block.pins += 1
            self.stats.hits += 1
            self.stats.hit_tokens += tokens
        return PrefixHit(found, blocks, tokens)

    def release(self, hit: PrefixHit | None) -> None:
        """Unpins a hit's blocks (they may be evicted again)."""
        if hit is None:
            return
        with self._lock:
            for block in hit.blocks:
                block.pins -= 1

    def insert(self, token_ids: torch.Tensor | list[int], k: torch.Tensor, v: torch.Tensor, start: int = 0) -> int:
        """Caches the prompt's whole blocks from token `start` on (K, V [L, n', H, d] hold tokens [start, ...)):
        blocks already cached are only touched; returns the blocks added. `start` is a block boundary."""
        if not self.enabled:
            return 0
        if start % self.block_tokens:
            raise ValueError(f"insert starts at token {start}, not a multiple of {self.block_tokens}")
        keys = self.keys(token_ids)
        first = start // self.block_tokens
        added = 0
        with self._lock:
            now = self.clock()
            events: list[CacheEvent] = []
            # the prompt's cached blocks are held while room is made, so its head is never evicted for its tail
            held = [self._blocks[key] for key in keys[:first] if key in self._blocks]
            for block in held:
                block.pins += 1
            try:
                for index in range(first, len(keys)):
                    lo = index * self.block_tokens - start
                    if lo + self.block_tokens > k.shape[1]:
                        break
                    if keys[index] in self._blocks:  # held too: the next block's room must not cost it its parent
                        self._blocks[keys[index]].pins += 1
                        held.append(self._blocks[keys[index]])
                        continue
                    parent = keys[index - 1] if index else None
                    if parent is not None and parent not in self._blocks:
                        break  # its prefix is not cached (evicted meanwhile): a match could never reach it
                    block = _Block(
                        k[:, lo : lo + self.block_tokens].clone(), v[:, lo : lo + self.block_tokens].clone(), parent
                    )
                    if not self._make_room(block.nbytes, now, events, (keys[index], index, block.nbytes)):
                        break
                    self._blocks[keys[index]] = block
                    if parent is not None:
                        self._blocks[parent].children += 1
                    self.retention.added(keys[index], index, block.nbytes, now)
                    block.pins += 1
                    held.append(block)
                    self._bytes += block.nbytes
                    added += 1
                    if self.listener is not None:
                        self._stored(events, keys[index], parent, token_ids, index, block.k)
            finally:
                for block in held:
                    block.pins -= 1
            for key in reversed(keys):  # the head ends most recent: the tail is evicted first
                if key in self._blocks:
                    self.retention.touch(key, now)
            self.stats.inserted_blocks += added
            if events and self.listener is not None:
                self.listener(events)
        return added

    def _stored(
        self, events: list[CacheEvent], key: bytes, parent: bytes | None, token_ids: Any, index: int, k: torch.Tensor
    ) -> None:
        """Adds one stored block to `events`: to the last BlocksStored when it continues that run."""
        lo = index * self.block_tokens
        tokens = [int(t) for t in torch.as_tensor(token_ids).flatten()[lo : lo + self.block_tokens].tolist()]
        last = events[-1] if events else None
        if isinstance(last, BlocksStored) and last.keys[-1] == parent:
            last.keys.append(key)
            last.token_ids.extend(tokens)
        else:
            events.append(BlocksStored([key], parent, tokens, self.block_tokens, _medium(k)))

    def _make_room(
        self,
        needed: int,
        now: float,
        events: list[CacheEvent],
        incoming: tuple[bytes, int, int] | None = None,
    ) -> bool:
        """Evicts the policy's victims (unpinned leaves) until `needed` more bytes fit the budget (lock held); False
        when pinned blocks leave no room or the policy declines the incoming block (key, index, bytes)."""
        if needed > self.budget_bytes:
            self.stats.refused_blocks += 1
            return False
        while self._bytes + needed > self.budget_bytes:
            key = self.retention.victim(now, self._evictable, incoming)
            if key is None:
                if any(self._evictable(key) for key in self._blocks):
                    self.stats.declined_blocks += 1
                else:
                    self.stats.refused_blocks += 1
                return False
            self._evict(key, now, events)
        return True

    def _evictable(self, key: bytes) -> bool:
        block = self._blocks[key]
        return not block.pins and not block.children

    def _evict(self, key: bytes, now: float, events: list[CacheEvent]) -> None:
        block = self._blocks.pop(key)
        if block.parent is not None and block.parent in self._blocks:
            self._blocks[block.parent].children -= 1
        self._bytes -= block.nbytes
        self.retention.removed(key, now)
        self.stats.evicted_blocks += 1
        if self.listener is not None:
            last = events[-1] if events else None
            if isinstance(last, BlocksRemoved):
                last.keys.append(key)
            else:
                events.append(BlocksRemoved([key], _medium(block.k)))

    @property
    def bytes_held(self) -> int:
        with self._lock:
            return self._bytes

    @property
    def num_blocks(self) -> int:
        with self._lock:
            return len(self._blocks)

    def snapshot(self) -> dict[str, Any]:
        """What /status and /metrics show."""
        with self._lock:
            stats = self.stats
            return {
                "enabled": self.enabled,
                "budget_bytes": self.budget_bytes,
                "block_tokens": self.block_tokens,
                "bytes": self._bytes,
                "blocks": len(self._blocks),
                "pinned_blocks": sum(1 for block in self._blocks.values() if block.pins),
                "lookups": stats.lookups,
                "hits": stats.hits,
                "lookup_tokens": stats.lookup_tokens,
                "hit_tokens": stats.hit_tokens,
                "hit_rate": stats.hit_tokens / stats.lookup_tokens if stats.lookup_tokens else 0.0,
                "inserted_blocks": stats.inserted_blocks,
                "evicted_blocks": stats.evicted_blocks,
                "refused_blocks": stats.refused_blocks,
                "declined_blocks": stats.declined_blocks,
                "retention": self.retention.snapshot(),
            }


def _medium(k: torch.Tensor) -> str:
    return "GPU" if k.device.type == "cuda" else "CPU"
