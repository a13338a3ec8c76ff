"""Per-layer int8 KV masks on the decode node, one entry per token and KV head: 0 = padding, 1 = local, 2 = remote."""

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
    """The mask matrices of every layer for every pool slot: int8 [L, S, N, H], one entry per (token, KV head).

    A push lands every head of its tokens, and the heads of a token are adjacent, so its mask
    write stays one run of bytes; a fetch lands only the (token, head) entries a step selected,
    so it never moves the heads no query looked at. An entry turns LOCAL only after its K and V
    are in the pool (the writer's job: data first, then mask), and nothing ever turns a LOCAL
    entry back to REMOTE while the slot is in use. A token is local when all its heads are.
    """

    def __init__(self, num_layers: int, num_slots: int, max_tokens: int, num_heads: int = 1) -> None:
        self.values = torch.zeros(num_layers, num_slots, max_tokens, num_heads, dtype=torch.int8)

    @property
    def num_layers(self) -> int:
        return self.values.shape[0]

    @property
    def num_heads(self) -> int:
        return self.values.shape[3]

    def layer(self, layer: int) -> torch.Tensor:
        """The [S, N, H] mask of one layer (a view: writes go to the table)."""
        return self.values[layer]

    def tokens_local(self, layer: int, slot: int, start: int, stop: int) -> torch.Tensor:
        """[stop - start] bool: the tokens of one layer all of whose heads are local."""
        return (self.values[layer, slot, start:stop] == LOCAL).all(dim=-1)

    def token_states(self, slot: int, length: int) -> torch.Tensor:
        """[L, length] int8, one value per token: LOCAL when every head is, PAD when every head is, else REMOTE
        (what the monitor draws)."""
        values = self.values[:, slot, :length]  # [L, n, H]
        local = (values == LOCAL).all(dim=-1)
        pad = (values == PAD).all(dim=-1)
        out = torch.full(local.shape, REMOTE, dtype=torch.int8)
        out[local] = LOCAL
        out[pad] = PAD
        return out

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
        """Marks every head of these tokens of one layer local."""
        self.values[layer, slot, positions] = LOCAL

    def set_local_entries(self, layer: int, slot: int, entries: torch.Tensor) -> None:
        """Marks (token, head) entries of one layer local; `entries` holds flat ids token * H + head."""
        self.values[layer, slot].view(-1)[entries] = LOCAL

    def append_local(self, slot: int, position: int) -> None:
        """A generated token is local in every layer from the moment it exists."""
        self.values[:, slot, position] = LOCAL

    def summary(self, layer: int, slot: int) -> MaskSummary:
        """Token counts of one layer: local when every head is, padding when every head is, else remote."""
        values = self.values[layer, slot]
        num_local = int((values == LOCAL).all(dim=-1).sum())
        num_pad = int((values == PAD).all(dim=-1).sum())
        return MaskSummary(num_pad, num_local, values.shape[0] - num_pad - num_local)

    def local_prefix(self, slot: int, length: int) -> int:
        """How many leading tokens of the slot's first `length` are local in every layer and head."""
        local = (self.values[:, slot, :length] == LOCAL).all(dim=2).all(dim=0).to(torch.int8)
        return int(local.cumprod(0).sum())

    def all_local(self, slot: int, length: int) -> bool:
        return bool((self.values[:, slot, :length] == LOCAL).all())
