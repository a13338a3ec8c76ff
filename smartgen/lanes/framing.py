"""Two-sided messages on a socket: one MESSAGE frame (JSON meta, then the payload tensors' raw bytes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from smartgen.lanes.base import Message, MessageKind
from smartgen.lanes.checks import check_payload_spec
from smartgen.lanes.wire import Frame

__all__ = ["bytes_view", "message_frame", "recv_message"]


def bytes_view(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of a CPU tensor's memory (no copy)."""
    flat = tensor.detach().reshape(-1)
    array = (flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)).numpy()
    return memoryview(array)  # type: ignore[arg-type]  # numpy declares __buffer__ only for Python >= 3.12


def message_frame(message: Message) -> tuple[dict[str, Any], list[memoryview]]:
    """A message's frame meta and payload parts; the caller sends the header, then the parts (paced or not)."""
    names = list(message.payload)
    tensors = [message.payload[n].detach().contiguous().cpu() for n in names]
    spec = [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in zip(names, tensors)]
    meta = {"kind": int(message.kind), "meta": message.meta, "payload": spec}
    return meta, [bytes_view(t) for t in tensors]


def recv_message(read_into: Callable[[memoryview], None], frame: Frame) -> Message:
    """Reads a MESSAGE frame's payload (`read_into` fills a view from the stream) into fresh tensors, allocated only
    once the spec checks out."""
    spec = check_payload_spec(frame.meta, frame.payload_length)
    try:
        kind = MessageKind(frame.meta["kind"])
    except ValueError:
        raise ConnectionError(f"unknown message kind {frame.meta['kind']}") from None
    tensors = {name: torch.empty(shape, dtype=dtype) for name, dtype, shape in spec}
    for tensor in tensors.values():
        if tensor.numel():
            read_into(bytes_view(tensor))
    return Message(kind, frame.request_id, frame.meta["meta"], tensors)
