"""Where one request's writes may land: byte ranges per region (its pool slot), checked for every descriptor."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence

__all__ = ["SlotExtents", "ExtentMap", "extents_meta", "parse_extents"]

# region name -> [(start, stop), ...] byte ranges; what the owner of the regions passes to `Lane.accept`
ExtentMap = Mapping[str, Sequence[tuple[int, int]]]


class SlotExtents:
    """A request's writable byte ranges; `allows` is a bisect per descriptor (thousands per batch)."""

    __slots__ = ("_ranges",)

    def __init__(self, extents: ExtentMap) -> None:
        self._ranges: dict[str, tuple[list[int], list[int]]] = {}
        for region, ranges in extents.items():
            ordered = sorted((int(a), int(b)) for a, b in ranges if b > a)
            self._ranges[region] = ([a for a, _ in ordered], [b for _, b in ordered])

    def allows(self, region: str, offset: int, length: int) -> bool:
        """True when [offset, offset + length) lies inside one of the region's ranges."""
        found = self._ranges.get(region)
        if found is None or length <= 0 or offset < 0:
            return False
        starts, stops = found
        i = bisect_right(starts, offset) - 1
        return i >= 0 and offset + length <= stops[i]


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
