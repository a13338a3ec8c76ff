"""A WRITE's descriptors as columns: encoded compactly for the wire (`table` meta) and checked as whole arrays.

Sent as a JSON list, each descriptor of a speculative push (thousands a frame, a few hundred bytes
each) cost the decode node about 3 us to parse and check, more than landing its bytes. A table is
the region names once and an int64 [n, 3] array (region index, offset, length) in base64: one
decode and a few whole-array checks, whatever n is.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["RowTable", "encode_table", "check_write_table", "MAX_REGIONS"]

MAX_REGIONS = 64  # region names one table may name
_MAX_OFFSET = 1 << 62  # offsets and lengths below this cannot overflow int64 when added


@dataclass(frozen=True)
class RowTable:
    """n write rows: `names[codes[i]]` gets `lengths[i]` bytes at `offsets[i]` (int64 arrays), row after row."""

    names: list[str]
    codes: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.codes)

    def as_ops(self) -> list[tuple[str, int, int]]:
        """[(region, offset, length), ...]: the rows one by one (`check_write_ops`'s form)."""
        names = self.names
        return [(names[c], o, n) for c, o, n in zip(self.codes.tolist(), self.offsets.tolist(), self.lengths.tolist())]

    @classmethod
    def from_ops(cls, ops: Sequence[tuple[str, int, int]]) -> RowTable:
        """The columns of checked (region, offset, length) descriptors."""
        if not ops:
            empty = np.zeros(0, dtype=np.int64)
            return cls([], empty, empty, empty)
        regions, offsets, lengths = zip(*ops)
        names = list(dict.fromkeys(regions))
        code_of = {name: i for i, name in enumerate(names)}
        codes = np.array([code_of[name] for name in regions], dtype=np.int64)
        return cls(names, codes, np.array(offsets, dtype=np.int64), np.array(lengths, dtype=np.int64))


def encode_table(names: list[str], codes: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> dict[str, Any]:
    """A WRITE meta's `table`: the region names and the rows as base64 of little-endian int64 [n, 3]."""
    rows = np.stack([codes, offsets, lengths], axis=1).astype("<i8", copy=False)
    return {"regions": names, "rows": base64.b64encode(rows.tobytes()).decode("ascii")}


def check_write_table(table: Any, payload_length: int, max_rows: int) -> RowTable:
    """A WRITE's `table`, decoded and checked: known region indices, non-negative offsets, positive lengths adding
    up to the payload, at most `max_rows` rows. A ConnectionError names what is wrong (it came off the wire)."""
    if not isinstance(table, dict) or set(table) != {"regions", "rows"}:
        raise ConnectionError("WRITE frame: table is not an object of regions and rows")
    names, encoded = table["regions"], table["rows"]
    if not (isinstance(names, list) and 0 < len(names) <= MAX_REGIONS and all(type(n) is str for n in names)):
        raise ConnectionError(f"WRITE frame: table regions must be 1 to {MAX_REGIONS} names")
    if not isinstance(encoded, str):
        raise ConnectionError("WRITE frame: table rows must be a base64 string")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ConnectionError(f"WRITE frame: table rows are not base64: {exc}") from None
    if len(raw) % 24 or len(raw) // 24 > max_rows:
        raise ConnectionError(f"WRITE frame: table rows must be whole [n, 3] int64 rows, at most {max_rows}")
    rows = np.frombuffer(raw, dtype="<i8").reshape(-1, 3).astype(np.int64)
    codes, offsets, lengths = (np.ascontiguousarray(rows[:, i]) for i in range(3))
    if len(rows) and (codes.min() < 0 or codes.max() >= len(names)):
        raise ConnectionError("WRITE frame: a table row names a region the table does not list")
    if len(rows) and (offsets.min() < 0 or offsets.max() >= _MAX_OFFSET or lengths.min() <= 0):
        raise ConnectionError("WRITE frame: a table row has a negative offset or a length that is not positive")
    if len(rows) and lengths.max() > payload_length or int(lengths.sum()) != payload_length:
        raise ConnectionError(f"WRITE frame: table rows do not add up to the payload's {payload_length} bytes")
    return RowTable(list(names), codes, offsets, lengths)
