"""What a one-sided lane needs from its transport (Mooncake, NIXL, RDMA): memory registration and write lists."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["TransportError", "DeviceMemoryUnsupported", "Segment", "Transport", "SourceCache"]


class TransportError(ConnectionError):
    """The transport failed a write or could not reach the peer; the lane closes with this reason."""


class DeviceMemoryUnsupported(ValueError):
    """A region on a device (a GPU) offered to a transport that registers host memory only here."""


class Segment(NamedTuple):
    """One resolved write: `length` bytes from local `src_addr` to the peer's `dst_addr`."""

    src_addr: int
    dst_addr: int
    length: int
    src_key: Any  # what `register` returned for the source's registration (an lkey on RDMA)
    dst_key: Any  # the peer region's key from its REGION frame (an rkey on RDMA)


class Transport(ABC):
    """One endpoint's transport; a lane owns one and closes it."""

    name: str
    # True when one write list is applied at the peer in posting order (RDMA RC); otherwise the lane
    # fences between runs of writes to different regions, so a mask never lands before its data.
    ordered: bool = False

    @abstractmethod
    def info(self) -> dict[str, Any]:
        """What the peer needs to reach this endpoint (JSON), sent once in LANE_INFO."""

    @abstractmethod
    def connect(self, peer: dict[str, Any]) -> None:
        """Connects to the peer described by its LANE_INFO."""

    @classmethod
    def registers_device_memory(cls, device: torch.device) -> bool:
        """Whether `register` takes memory on `device` (a GPU) on this host, so writes land there without a copy
        through host memory; asked before any endpoint exists (the decode node stages its pool when not)."""
        return False

    @abstractmethod
    def register(self, tensor: torch.Tensor) -> tuple[Any, Any]:
        """Registers a flat uint8 tensor (host memory, or device memory where `registers_device_memory` says so);
        returns (local handle, key for the peer, JSON)."""

    def region_address(self, handle: Any, tensor: torch.Tensor) -> int:
        """The address the peer's writes give `tensor`'s first byte: its pointer, unless the registration
        (`handle`) addresses memory otherwise (an RDMA DMA-BUF MR counts from its offset in the dma-buf)."""
        return tensor.data_ptr()

    @abstractmethod
    def deregister(self, handle: Any) -> None:
        """Drops a registration: writes into it fail from now on."""

    def peer_region(self, key: Any) -> Any:
        """Turns a peer region's key (from its REGION frame) into what `write` needs; NIXL refreshes the peer here."""
        return key

    @abstractmethod
    def write(self, segments: Sequence[Segment]) -> None:
        """Writes the segments as one batch; returns once all have landed; raises TransportError."""

    @abstractmethod
    def close(self) -> None:
        """Deregisters everything and releases the transport."""


class SourceCache:
    """Registrations of the writer's source tensors, reused across batches and evicted least recently used.

    Each entry holds a reference to its tensor, so registered memory is never freed and reused
    under a stale registration (pinned pages on RDMA would then no longer be the tensor's).
    """

    def __init__(self, transport: Transport, capacity: int = 64) -> None:
        self._transport = transport
        self._capacity = capacity
        self._entries: OrderedDict[tuple[int, int], tuple[torch.Tensor, Any]] = OrderedDict()

    def key_for(self, tensor: torch.Tensor) -> Any:
        """The registration handle covering `tensor` (registering it on first use)."""
        start, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        for (base, length), (_, handle) in self._entries.items():
            if base <= start and start + size <= base + length:
                self._entries.move_to_end((base, length))
                return handle
        handle, _ = self._transport.register(tensor)
        self._entries[(start, size)] = (tensor, handle)
        while len(self._entries) > self._capacity:
            _, (_, old) = self._entries.popitem(last=False)
            self._transport.deregister(old)
        return handle

    def clear(self) -> None:
        while self._entries:
            _, (_, handle) = self._entries.popitem(last=False)
            self._transport.deregister(handle)
