"""A KV prefix cache keyed by chained hashes of token blocks, under a byte budget with LRU eviction.

Both roles keep one: the prefill node to skip prefill of a cached prefix, the decode node to
skip transferring KV it already holds. A block of `block_tokens` tokens is keyed by a hash of
its tokens chained with the hash of the block before it, so a key names the whole prefix up to
and including its block, and a prompt's cached part is the longest leading run of keys found.

A hit pins its blocks until `release`: a block in use is never evicted. Touched blocks become
most recent deepest-first, so eviction takes a prefix's tail before its head (a head evicted
would strand every block after it).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["DEFAULT_BLOCK_TOKENS", "block_hashes", "PrefixHit", "PrefixCache", "PrefixCacheStats"]

DEFAULT_BLOCK_TOKENS = 16


def block_hashes(token_ids: torch.Tensor | list[int], block_tokens: int, salt: str = "") -> list[bytes]:
    """Chained keys of each whole block of `token_ids`: key i covers tokens [0, (i + 1) · block_tokens)."""
    ids = torch.as_tensor(token_ids, dtype=torch.int64).flatten().cpu()
    keys = []
    previous = hashlib.blake2b(salt.encode(), digest_size=16).digest()
    for start in range(0, ids.numel() - block_tokens + 1, block_tokens):
        previous = hashlib.blake2b(
            previous + ids[start : start + block_tokens].numpy().tobytes(), digest_size=16
        ).digest()
        keys.append(previous)
    return keys


@dataclass(slots=True)
class _Block:
    k: torch.Tensor  # [L, B, H, d]
    v: torch.Tensor
    pins: int = 0

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


class PrefixCache:
    """Token-block KV under `budget_bytes` (0 turns it off: nothing is kept, nothing found)."""

    def __init__(self, budget_bytes: int, block_tokens: int = DEFAULT_BLOCK_TOKENS, salt: str = "") -> None:
        if budget_bytes < 0:
            raise ValueError("a prefix cache budget cannot be negative")
        if block_tokens < 1:
            raise ValueError("a prefix cache block holds at least one token")
        self.budget_bytes = budget_bytes
        self.block_tokens = block_tokens
        self.salt = salt
        self.stats = PrefixCacheStats()
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()

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
            for key in reversed(found):  # the head ends most recent: the tail is evicted first
                self._blocks.move_to_end(key)
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
            # the prompt's cached blocks are held while room is made, so its head is never evicted for its tail
            held = [self._blocks[key] for key in keys[:first] if key in self._blocks]
            for block in held:
                block.pins += 1
            try:
                for index in range(first, len(keys)):
                    lo = index * self.block_tokens - start
                    if lo + self.block_tokens > k.shape[1]:
                        break
                    if keys[index] in self._blocks:
                        continue
                    block = _Block(k[:, lo : lo + self.block_tokens].clone(), v[:, lo : lo + self.block_tokens].clone())
                    if not self._make_room(block.nbytes):
                        self.stats.refused_blocks += 1
                        break
                    self._blocks[keys[index]] = block
                    block.pins += 1
                    held.append(block)
                    self._bytes += block.nbytes
                    added += 1
            finally:
                for block in held:
                    block.pins -= 1
            for key in reversed(keys):  # the head ends most recent: the tail is evicted first
                if key in self._blocks:
                    self._blocks.move_to_end(key)
            self.stats.inserted_blocks += added
        return added

    def _make_room(self, needed: int = 0) -> bool:
        """Drops least recently used unpinned blocks until `needed` more bytes fit the budget (lock held);
        False when pinned blocks leave no room."""
        if needed > self.budget_bytes:
            return False
        for key in list(self._blocks):
            if self._bytes + needed <= self.budget_bytes:
                break
            block = self._blocks[key]
            if block.pins:
                continue
            del self._blocks[key]
            self._bytes -= block.nbytes
            self.stats.evicted_blocks += 1
        return self._bytes + needed <= self.budget_bytes

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
            }
