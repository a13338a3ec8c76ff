"""Which prefix-cache blocks stay when room is needed: least recently used, or the most saved seconds per byte.

A retention policy sees a block stored, hit, touched and removed, and names the next block to evict among those the
cache says it may evict (unpinned leaves: a block whose child is cached is never evicted before the child, so no
cached block ever loses its prefix). Two policies:

- `lru`: the least recently used block goes first (blocks touched deepest-first, so a prefix's tail leaves before
  its head).
- `cost`: keeps the blocks whose expected saved seconds per byte per second held are highest: the block's reuse rate
  (learned from the cache's own hit history by hit count and age, `ReuseModel`) times what a miss on it would cost
  (`MissCost`: link time on a decode node, recompute time on a prefill node, where a block later in the prompt costs
  more as attention grows with position) over its bytes. Age is the aging term: a block unused for long falls in
  worth and leaves. Evicted blocks' keys and hit counts are remembered (metadata only, "ghosts") so that a block that
  comes back gets its history back, and the model sees reuses the cache did not hold. With `admission` (off by
  default: on the Mooncake conversation trace it refused the first turn's blocks of conversations that went on, and
  lost hits), a new block that is worth less than every block it would displace is not stored.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from smartgen.engine.reuse_model import NUM_CLASSES, ReuseModel

__all__ = [
    "RETENTIONS",
    "MissCost",
    "LinkCost",
    "ComputeCost",
    "Retention",
    "LruRetention",
    "CostRetention",
    "make_retention",
]

RETENTIONS = ("lru", "cost")
SCAN_FACTOR = 16  # cost: blocks looked at per hit class and eviction, per candidate, before all are
Evictable = Callable[[bytes], bool]


class MissCost(Protocol):
    def seconds(self, index: int, nbytes: int) -> float:
        """What a miss on block `index` (0 = the prompt's first) of `nbytes` bytes costs, in seconds."""
        ...


@dataclass(frozen=True, slots=True)
class LinkCost:
    """A decode node's miss: the block crosses the link again."""

    gbps: float

    def __post_init__(self) -> None:
        if not self.gbps > 0:
            raise ValueError(f"a link rate is positive, got {self.gbps}")

    def seconds(self, index: int, nbytes: int) -> float:
        return nbytes * 8 / (self.gbps * 1e9)


@dataclass(frozen=True, slots=True)
class ComputeCost:
    """A prefill node's miss: the block's tokens are prefilled again. Linear layers cost the same per token; attention
    grows with the token's position, so block `index` of `block_tokens` tokens costs
    block_tokens · linear + attention · Σ positions, over `flops_per_second`."""

    block_tokens: int
    linear_flops_per_token: float  # 2 · parameters
    attention_flops_per_pair: float  # 4 · layers · query width (QKᵀ and PV, 2 flops a multiply-add)
    flops_per_second: float = 100e12

    @classmethod
    def for_model(
        cls, num_parameters: int, num_layers: int, query_width: int, block_tokens: int, flops_per_second: float = 100e12
    ) -> ComputeCost:
        return cls(block_tokens, 2.0 * num_parameters, 4.0 * num_layers * query_width, flops_per_second)

    def seconds(self, index: int, nbytes: int) -> float:
        t = self.block_tokens
        pairs = t * index * t + t * (t + 1) / 2  # each token attends to every token before it and itself
        return (t * self.linear_flops_per_token + pairs * self.attention_flops_per_pair) / self.flops_per_second


class Retention(Protocol):
    name: str

    def added(self, key: bytes, index: int, nbytes: int, now: float) -> None: ...

    def hit(self, key: bytes, now: float) -> None: ...

    def touch(self, key: bytes, now: float) -> None: ...

    def removed(self, key: bytes, now: float) -> None: ...

    def victim(self, now: float, evictable: Evictable, incoming: tuple[bytes, int, int] | None = None) -> bytes | None:
        """The block to evict next, or None: nothing evictable, or (`incoming` = (key, index, nbytes) of the block
        that needs the room) the incoming block is worth less than any block it would displace."""
        ...

    def snapshot(self) -> dict[str, Any]: ...


class LruRetention:
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()  # least recently used first

    def added(self, key: bytes, index: int, nbytes: int, now: float) -> None:
        self._order[key] = None

    def hit(self, key: bytes, now: float) -> None:
        self._order.move_to_end(key)

    touch = hit

    def removed(self, key: bytes, now: float) -> None:
        del self._order[key]

    def victim(self, now: float, evictable: Evictable, incoming: tuple[bytes, int, int] | None = None) -> bytes | None:
        return next((key for key in self._order if evictable(key)), None)

    def snapshot(self) -> dict[str, Any]:
        return {"name": self.name}


@dataclass(slots=True)
class _Entry:
    hits: int
    last: float
    index: int
    nbytes: int


class CostRetention:
    name = "cost"

    def __init__(
        self,
        cost: MissCost,
        model: ReuseModel | None = None,
        candidates: int = 4,
        ghost_factor: int = 4,
        admission: bool = False,
    ) -> None:
        """`candidates`: the oldest evictable blocks of each hit class compared per eviction; `ghost_factor`: evicted
        keys remembered, as a multiple of the most blocks held."""
        if candidates < 1 or ghost_factor < 0:
            raise ValueError("candidates is at least 1 and ghost_factor at least 0")
        self.cost, self.model = cost, model or ReuseModel()
        self.candidates, self.ghost_factor, self.admission = candidates, ghost_factor, admission
        self._entries: dict[bytes, _Entry] = {}
        # every block by hit class, least recently used first (a block keeps its place while it has children, so it
        # is weighed at its true recency once they are gone)
        self._classes: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(NUM_CLASSES)]
        self._ghosts: OrderedDict[bytes, tuple[int, float]] = OrderedDict()  # evicted: (hits, last use)
        self._most_held = 0
        self.declined = 0  # blocks not admitted

    def worth(self, hits: int, age: float, index: int, nbytes: int) -> float:
        """Expected saved seconds per byte per second held."""
        return self.model.rate(hits, age) * self.cost.seconds(index, nbytes) / max(nbytes, 1)

    def added(self, key: bytes, index: int, nbytes: int, now: float) -> None:
        hits = 0
        ghost = self._ghosts.pop(key, None)
        if ghost is not None:  # it was cached before and came back: a reuse the cache missed, and its history returns
            self.model.observe(ghost[0], now - ghost[1], True)
            hits = ghost[0] + 1
        self._entries[key] = _Entry(hits, now, index, nbytes)
        self._classes[ReuseModel.hit_class(hits)][key] = None
        self._most_held = max(self._most_held, len(self._entries))

    def hit(self, key: bytes, now: float) -> None:
        entry = self._entries[key]
        self.model.observe(entry.hits, now - entry.last, True)
        del self._classes[ReuseModel.hit_class(entry.hits)][key]
        entry.hits += 1
        entry.last = now
        self._classes[ReuseModel.hit_class(entry.hits)][key] = None

    def touch(self, key: bytes, now: float) -> None:
        entry = self._entries[key]
        entry.last = now
        self._classes[ReuseModel.hit_class(entry.hits)].move_to_end(key)

    def removed(self, key: bytes, now: float) -> None:
        entry = self._entries.pop(key)
        del self._classes[ReuseModel.hit_class(entry.hits)][key]
        self._remember(key, entry.hits, entry.last, now)

    def victim(self, now: float, evictable: Evictable, incoming: tuple[bytes, int, int] | None = None) -> bytes | None:
        best, chosen = self._least_worth(now, evictable, self.candidates * SCAN_FACTOR)
        if chosen is None:  # every class's oldest blocks had children or pins: look at all of them
            best, chosen = self._least_worth(now, evictable, None)
        if chosen is None or best is None or incoming is None or not self.admission:
            return chosen
        key, index, nbytes = incoming
        ghost = self._ghosts.get(key)
        hits = 0 if ghost is None else ghost[0] + 1  # as `added` would count it
        if self.worth(hits, 0.0, index, nbytes) >= best[0]:
            return chosen
        self.declined += 1
        if ghost is not None:
            self.model.observe(ghost[0], now - ghost[1], True)
        self._remember(key, hits, now, now)  # seen now: if it comes back, it has this history
        return None

    def _least_worth(
        self, now: float, evictable: Evictable, scan: int | None
    ) -> tuple[tuple[float, float] | None, bytes | None]:
        """The least worth (and its key) among the oldest `candidates` evictable blocks of each hit class, looking at
        most `scan` blocks a class (None: all): a block with cached children keeps its place in the order and is passed
        over, and a bounded scan keeps a run of them (a hot shared prefix) from costing every eviction its length."""
        best: tuple[float, float] | None = None
        chosen = None
        for keys in self._classes:
            found = looked = 0
            for key in keys:  # least recently used first
                if found >= self.candidates or (scan is not None and looked >= scan):
                    break
                looked += 1
                if not evictable(key):
                    continue
                found += 1
                entry = self._entries[key]
                rank = (self.worth(entry.hits, now - entry.last, entry.index, entry.nbytes), entry.last)
                if best is None or rank < best:
                    best, chosen = rank, key
        return best, chosen

    def _remember(self, key: bytes, hits: int, last: float, now: float) -> None:
        self._ghosts.pop(key, None)
        self._ghosts[key] = (hits, last)
        while len(self._ghosts) > max(self.ghost_factor * self._most_held, 1024 if self.ghost_factor else 0):
            _, (old_hits, old_last) = self._ghosts.popitem(last=False)
            self.model.observe(old_hits, now - old_last, False)  # forgotten unused: censored at this age

    def snapshot(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "remembered_keys": len(self._ghosts),
            "declined_blocks": self.declined,
            "observations": self.model.observations,
        }


def make_retention(name: str, cost: MissCost | None = None) -> Retention:
    """A policy by name (`RETENTIONS`); `cost` is what a miss costs on this node (the cost policy needs it)."""
    if name == "lru":
        return LruRetention()
    if name == "cost":
        if cost is None:
            raise ValueError("the cost retention policy needs a miss cost (LinkCost or ComputeCost)")
        return CostRetention(cost)
    raise ValueError(f"prefix retention must be one of {', '.join(RETENTIONS)}, got {name!r}")
