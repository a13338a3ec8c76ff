"""Checks on what a peer's frame claims, done before any of its bytes are read into memory.

A frame that fails a check raises ConnectionError with the reason: the lane closes that one
connection and logs why; the node goes on serving its other peers.
"""

from __future__ import annotations

import socket
from typing import Any

import torch

from smartgen.lanes.row_table import RowTable, check_write_table
from smartgen.lanes.wire import recv_into_exact

__all__ = ["check_write", "check_write_ops", "check_ack", "check_payload_spec", "drain", "MAX_MESSAGE_BYTES", "MAX_OPS"]

MAX_MESSAGE_BYTES = 4 * 2**30  # a message's tensors (a fetch reply of a long prompt is ~100s of MiB)
MAX_OPS = 1 << 20  # descriptors in one WRITE
_DRAIN_CHUNK = 1 << 20


def _int(value: Any, what: str) -> int:
    if type(value) is not int:  # bool is an int subclass; JSON floats are not offsets
        raise ConnectionError(f"{what} is not an integer: {value!r}")
    return value


def check_write(meta: dict[str, Any], payload_length: int) -> list[tuple[str, int, int]] | RowTable:
    """A WRITE's descriptors, checked: a RowTable where the sender sent them as a table (`row_table`), else the
    list `check_write_ops` makes of its `ops`."""
    if "table" not in meta:
        return check_write_ops(meta, payload_length)
    _int(meta.get("seq"), "WRITE seq")
    if "ops" in meta:
        raise ConnectionError("WRITE frame: both ops and a table")
    return check_write_table(meta["table"], payload_length, MAX_OPS)


def check_write_ops(meta: dict[str, Any], payload_length: int) -> list[tuple[str, int, int]]:
    """A WRITE's descriptors [(region, offset, length)]: well-typed, non-negative, adding up to the payload."""
    ops = meta.get("ops")
    _int(meta.get("seq"), "WRITE seq")
    if not isinstance(ops, list) or len(ops) > MAX_OPS:
        raise ConnectionError(f"WRITE frame: ops is not a list of at most {MAX_OPS} descriptors")
    fast = _well_formed(ops, payload_length)
    return fast if fast is not None else _check_each(ops, payload_length)


def _check_each(ops: list[Any], payload_length: int) -> list[tuple[str, int, int]]:
    """The same checks one descriptor at a time: names the first bad one (`_well_formed` only says that one is)."""
    checked = []
    total = 0
    for op in ops:
        if not (isinstance(op, list) and len(op) == 3 and isinstance(op[0], str)):
            raise ConnectionError(f"WRITE frame: bad descriptor {op!r}")
        offset, length = _int(op[1], "WRITE offset"), _int(op[2], "WRITE length")
        if offset < 0 or length <= 0:
            raise ConnectionError(f"WRITE frame: descriptor with offset {offset}, length {length}")
        total += length
        checked.append((op[0], offset, length))
    if total != payload_length:
        raise ConnectionError(f"WRITE frame: descriptors add up to {total} bytes, the payload is {payload_length}")
    return checked


def _well_formed(ops: list[Any], payload_length: int) -> list[tuple[str, int, int]] | None:
    """`check_write_ops`'s checks as whole-list passes in C (a speculative push lands thousands of descriptors a
    step on the decode node's one CPU; the per-descriptor loop cost ~2 us each); None when any check fails."""
    if not ops:
        return [] if payload_length == 0 else None
    if set(map(type, ops)) != {list} or set(map(len, ops)) != {3}:
        return None
    regions, offsets, lengths = zip(*ops)
    if set(map(type, regions)) != {str} or set(map(type, offsets)) | set(map(type, lengths)) != {int}:
        return None  # type(), not isinstance: a bool is not an offset
    if min(offsets) < 0 or min(lengths) <= 0 or sum(lengths) != payload_length:
        return None
    return list(zip(regions, offsets, lengths))


def check_ack(meta: dict[str, Any]) -> tuple[int, set[int]]:
    """An ACK's `seq` (every WRITE up to it is done) and the set of those WRITEs it says were `dropped`."""
    seq = _int(meta.get("seq"), "ACK seq")
    dropped = meta.get("dropped", [])
    if not isinstance(dropped, list) or len(dropped) > MAX_OPS:
        raise ConnectionError("ACK frame: dropped is not a list of WRITE seqs")
    return seq, {_int(s, "ACK dropped seq") for s in dropped}


def check_payload_spec(meta: dict[str, Any], payload_length: int) -> list[tuple[str, torch.dtype, list[int]]]:
    """A MESSAGE's tensor list [(name, dtype, shape)]; its byte size must equal the payload, under the cap."""
    spec = meta.get("payload")
    if not isinstance(spec, list) or not isinstance(meta.get("meta"), dict):
        raise ConnectionError("MESSAGE frame: payload spec or meta missing")
    _int(meta.get("kind"), "MESSAGE kind")
    checked = []
    declared = 0
    for entry in spec:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)):
            raise ConnectionError(f"MESSAGE frame: bad tensor entry {entry!r}")
        name, dtype_name, shape = entry
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype):
            raise ConnectionError(f"unknown payload dtype {dtype_name!r}")
        if not isinstance(shape, list) or len(shape) > 8:
            raise ConnectionError(f"MESSAGE frame: bad shape {shape!r}")
        numel = 1
        for dim in shape:
            if _int(dim, "tensor dimension") < 0:
                raise ConnectionError(f"MESSAGE frame: negative dimension in {shape!r}")
            numel *= dim
        declared += numel * dtype.itemsize
        if declared > MAX_MESSAGE_BYTES:
            raise ConnectionError(f"MESSAGE frame: tensors of more than {MAX_MESSAGE_BYTES} bytes")
        checked.append((name, dtype, shape))
    if declared != payload_length:
        raise ConnectionError(f"message payload of {payload_length} bytes, its tensors need {declared}")
    return checked


def drain(sock: socket.socket, length: int) -> None:
    """Reads and drops `length` bytes (a refused write's payload) in bounded chunks."""
    scratch = memoryview(bytearray(min(length, _DRAIN_CHUNK)))
    while length:
        step = min(length, len(scratch))
        recv_into_exact(sock, scratch[:step])
        length -= step
