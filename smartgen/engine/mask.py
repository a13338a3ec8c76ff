"""Per-layer int8 KV masks on the decode node: 0 = padding, 1 = local, 2 = remote."""

from __future__ import annotations

from typing import NamedTuple

import torch

PAD = 0
LOCAL = 1
REMOTE = 2

__all__ = ["PAD", "LOCAL", "REMOTE", "MaskTable", "MaskSummary"]


class MaskSummary(NamedTuple):
    """Counts of mask values for one layer of one request (what the monitor shows)."""

    num_pad: int
    num_local: int
    num_remote: int


class MaskTable:
    """The mask matrices of every layer for every pool slot: int8 [L, S, N].

    All heads of a token share one mask value. A token's entry turns LOCAL only after its
    K and V are in the pool (the writer's job: data first, then mask), and nothing ever
    turns a LOCAL entry back to REMOTE while the slot is in use.
    """

    def __init__(self, num_layers: int, num_slots: int, max_tokens: int) -> None:
        self.values = torch.zeros(num_layers, num_slots, max_tokens, dtype=torch.int8)

    @property
    def num_layers(self) -> int:
        return self.values.shape[0]

    def layer(self, layer: int) -> torch.Tensor:
        """The [S, N] mask of one layer (a view: writes go to the table)."""
        return self.values[layer]

    def open(self, slot: int, length: int) -> None:
        """A new request: its prompt tokens are remote, the rest of the slot padding."""
        self.values[:, slot, :length] = REMOTE
        self.values[:, slot, length:] = PAD

    def close(self, slot: int) -> None:
        self.values[:, slot, :] = PAD

    def set_local(self, layer: int, slot: int, start: int, stop: int) -> None:
        """Marks tokens [start, stop) of one layer local: call only once their K/V are in place."""
        self.values[layer, slot, start:stop] = LOCAL

    def set_local_tokens(self, layer: int, slot: int, positions: torch.Tensor) -> None:
        self.values[layer, slot, positions] = LOCAL

    def append_local(self, slot: int, position: int) -> None:
        """A generated token is local in every layer from the moment it exists."""
        self.values[:, slot, position] = LOCAL

    def summary(self, layer: int, slot: int) -> MaskSummary:
        counts = torch.bincount(self.values[layer, slot].long(), minlength=3)
        return MaskSummary(int(counts[PAD]), int(counts[LOCAL]), int(counts[REMOTE]))

    def local_prefix(self, slot: int, length: int) -> int:
        """How many leading tokens of the slot's first `length` are local in every layer."""
        local = (self.values[:, slot, :length] == LOCAL).all(dim=0).to(torch.int8)
        return int(local.cumprod(0).sum())

    def all_local(self, slot: int, length: int) -> bool:
        return bool((self.values[:, slot, :length] == LOCAL).all())
