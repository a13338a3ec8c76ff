"""Learns, from the reuses a prefix cache has seen, how often a block of a given hit count and age is reused per second held.

The estimate is a hazard table (as a survival analysis keeps one): for each hit class (a block stored and never hit,
hit once, twice, three times, four or more) and each age bucket (seconds since the block was last used, log-spaced),
the share of blocks that reached the bucket unused and were reused within it. A block's worth to keep is then the
best reuse rate it can offer from its age on: the most expected reuses per second held over any horizon, the index a
cache compares across blocks. Blocks are observed when they are reused (in the cache, or after eviction while the
cache still remembers their key) and when the cache forgets them (censored: unused up to that age), so the table
learns beyond the ages the cache itself keeps blocks for. Pure arithmetic: no clock, no cache, no tensors.
"""

from __future__ import annotations

import bisect

__all__ = ["AGE_EDGES", "NUM_CLASSES", "ReuseModel"]

# seconds: 0, then 0.1 s doubling every two buckets up to about 1.8 hours (a replayed trace runs at any time scale)
AGE_EDGES = (0.0, *(0.1 * 2 ** (i / 2) for i in range(33)))
NUM_CLASSES = 5  # hits so far: 0 (only stored), 1, 2, 3, 4 or more
_NUM_BUCKETS = len(AGE_EDGES) - 1
_WIDTHS = tuple(AGE_EDGES[i + 1] - AGE_EDGES[i] for i in range(_NUM_BUCKETS))
# a weak prior, the same for every class: before any data the index falls with age alone, which ranks blocks as LRU does
_PRIOR_REUSED, _PRIOR_AT_RISK = 0.01, 1.0


class ReuseModel:
    """Reuse rates by (hits, age), learned online; `rate` is what a retention policy ranks by."""

    def __init__(self, rebuild_every: int = 500, half_life: int = 200_000) -> None:
        if rebuild_every < 1 or half_life < 1:
            raise ValueError("rebuild_every and half_life count observations: at least 1")
        self.rebuild_every, self.half_life = rebuild_every, half_life
        self.observations = 0
        self._at_risk = [[0.0] * _NUM_BUCKETS for _ in range(NUM_CLASSES)]  # reached the bucket unused
        self._reused = [[0.0] * _NUM_BUCKETS for _ in range(NUM_CLASSES)]  # ... and were reused within it
        self._index = [[0.0] * _NUM_BUCKETS for _ in range(NUM_CLASSES)]
        self._rebuild()

    @staticmethod
    def hit_class(hits: int) -> int:
        return min(max(hits, 0), NUM_CLASSES - 1)

    @staticmethod
    def age_bucket(age: float) -> int:
        return min(_NUM_BUCKETS - 1, max(0, bisect.bisect_right(AGE_EDGES, age) - 1))

    def observe(self, hits: int, age: float, reused: bool) -> None:
        """A block with `hits` hits so far, last used `age` seconds ago, was reused now (True) or forgotten unused."""
        c, b = self.hit_class(hits), self.age_bucket(age)
        at_risk = self._at_risk[c]
        for i in range(b + 1):
            at_risk[i] += 1.0
        if reused:
            self._reused[c][b] += 1.0
        self.observations += 1
        if self.observations % self.half_life == 0:  # old traffic counts half: the table follows a changing workload
            for table in (self._at_risk, self._reused):
                for row in table:
                    row[:] = [x / 2 for x in row]
        if self.observations % self.rebuild_every == 0:
            self._rebuild()

    def rate(self, hits: int, age: float) -> float:
        """Expected reuses per second held, from this age on (the best horizon's): higher is worth more to keep."""
        return self._index[self.hit_class(hits)][self.age_bucket(age)]

    def reuse_probability(self, hits: int, age: float) -> float:
        """The share of blocks like this one (unused until `age`) that are reused at some later age."""
        c = self.hit_class(hits)
        survive = 1.0
        for i in range(self.age_bucket(age), _NUM_BUCKETS):
            survive *= 1.0 - self._hazard(c, i)
        return 1.0 - survive

    def _hazard(self, c: int, i: int) -> float:
        return min(1.0, (self._reused[c][i] + _PRIOR_REUSED) / (self._at_risk[c][i] + _PRIOR_AT_RISK))

    def _rebuild(self) -> None:
        # index[c][j] = max over m >= j of expected reuses in buckets j..m / expected seconds held in them
        for c in range(NUM_CLASSES):
            hazards = [self._hazard(c, i) for i in range(_NUM_BUCKETS)]
            row = self._index[c]
            for j in range(_NUM_BUCKETS):
                best, survive, reuses, held = 0.0, 1.0, 0.0, 0.0
                for i in range(j, _NUM_BUCKETS):
                    reuses += survive * hazards[i]
                    held += survive * _WIDTHS[i] * (1.0 - hazards[i] / 2)  # a block reused mid-bucket left halfway
                    survive *= 1.0 - hazards[i]
                    if held > 0 and reuses / held > best:
                        best = reuses / held
                row[j] = best
