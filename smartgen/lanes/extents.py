"""Where one request's writes may land: byte ranges per region (its pool slot), checked for every descriptor."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["SlotExtents", "ExtentMap", "extents_meta", "parse_extents"]

# region name -> [(start, stop), ...] byte ranges; what the owner of the regions passes to `Lane.accept`
ExtentMap = Mapping[str, Sequence[tuple[int, int]]]


class SlotExtents:
    """A request's writable byte ranges; `allows` is a bisect per descriptor (thousands per batch)."""

    __slots__ = ("_ranges", "_arrays")

    def __init__(self, extents: ExtentMap) -> None:
        self._ranges: dict[str, tuple[list[int], list[int]]] = {}
        for region, ranges in extents.items():
            ordered = sorted((int(a), int(b)) for a, b in ranges if b > a)
            self._ranges[region] = ([a for a, _ in ordered], [b for _, b in ordered])
        self._arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # made on first `allows_many`

    def allows(self, region: str, offset: int, length: int) -> bool:
        """True when [offset, offset + length) lies inside one of the region's ranges."""
        found = self._ranges.get(region)
        if found is None or length <= 0 or offset < 0:
            return False
        starts, stops = found
        i = bisect_right(starts, offset) - 1
        return i >= 0 and offset + length <= stops[i]

    def allows_many(self, region: str, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """`allows` for many descriptors of one region at once (int64 arrays): one bool per descriptor."""
        found = self._ranges.get(region)
        if found is None or not found[0]:
            return np.zeros(len(offsets), dtype=bool)
        arrays = self._arrays.get(region)
        if arrays is None:
            arrays = self._arrays[region] = (np.array(found[0], dtype=np.int64), np.array(found[1], dtype=np.int64))
        starts, stops = arrays
        i = np.searchsorted(starts, offsets, side="right") - 1
        inside = offsets + lengths <= stops[np.maximum(i, 0)]
        return (i >= 0) & (lengths > 0) & (offsets >= 0) & inside


def extents_meta(extents: ExtentMap) -> dict[str, list[list[int]]]:
    """Extents as JSON for a frame's meta (one-sided lanes send them with ACCEPT)."""
    return {region: [[int(a), int(b)] for a, b in ranges] for region, ranges in extents.items()}


def parse_extents(meta: object) -> ExtentMap:
    """The inverse of `extents_meta`, checked: a ValueError names what is malformed (the frame came off the wire)."""
    if not isinstance(meta, dict):
        raise ValueError(f"extents must be an object, got {type(meta).__name__}")
    extents: dict[str, list[tuple[int, int]]] = {}
    for region, ranges in meta.items():
        if not isinstance(ranges, list):
            raise ValueError(f"extents of region {region!r} must be a list")
        pairs = []
        for pair in ranges:
            if not (isinstance(pair, list) and len(pair) == 2 and all(type(x) is int and x >= 0 for x in pair)):
                raise ValueError(f"an extent of region {region!r} must be [start, stop] of non-negative ints")
            pairs.append((pair[0], pair[1]))
        extents[str(region)] = pairs
    return extents
