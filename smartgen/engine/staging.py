"""Host staging for a decode pool on a device whose lane cannot register device memory: land on the host, copy in.

A one-sided lane (Mooncake, NIXL, RDMA without GPUDirect) writes K and V into host mirrors
and then marks the entries in a host *landing mask*, data before mask as everywhere. The
decoder never reads either: it reads the pool's own K, V and mask table on the device side,
and `sync` moves what has landed since the last call (one host->device copy per entry) before
the table says LOCAL. So an entry is LOCAL in the table only once the device rows hold it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from smartgen.engine.mask import LOCAL, MaskTable

__all__ = ["HostStaging"]

# (layers, slots, tokens, heads): the entries of [L, S, N, H] to move, as index tensors of one length
Where = tuple[torch.Tensor | int, ...]


class HostStaging:
    """Host mirrors of a pool's K and V [L, S, N, H, d] (pinned where CUDA is) and a landing mask [L, S, N, H]."""

    def __init__(self, shape: tuple[int, int, int, int, int], dtype: torch.dtype) -> None:
        pin = torch.cuda.is_available()
        self.k = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.v = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.landing = MaskTable(*shape[:4])

    def open(self, slot: int, length: int) -> None:
        """A new request in `slot`: nothing of it has landed."""
        self.landing.open(slot, length)

    def close(self, slot: int) -> None:
        self.landing.close(slot)

    def sync(self, layer: int | None, slots: Sequence[int], k: torch.Tensor, v: torch.Tensor, table: MaskTable) -> int:
        """Copies the entries of these slots (one layer, or every layer for None) that are LOCAL in the landing mask
        but not in `table` into the device K and V ([L, S, N, H, d]), then marks them in `table`; returns how many.
        Costs a mask comparison of the slots asked for, and a copy of only what is new."""
        if not slots:
            return 0
        layers = torch.arange(table.num_layers) if layer is None else torch.tensor([layer])
        rows = (layers[:, None], torch.as_tensor(list(slots), dtype=torch.int64)[None, :])
        # one read of the landing mask: what is copied and what is marked below are the same entries, whatever
        # the writer lands meanwhile (it is picked up next time)
        fresh = (self.landing.values[rows] == LOCAL) & (table.values[rows] != LOCAL)  # [l, B, N, H]
        at = fresh.nonzero(as_tuple=True)
        if not at[0].numel():
            return 0
        where = (layers[at[0]], rows[1][0, at[1]], at[2], at[3])
        self._copy(where, k, v)
        table.values[where] = LOCAL
        return int(at[0].numel())

    def land(
        self, layer: int, slot: int, entries: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: MaskTable
    ) -> None:
        """Entries (flat ids token * H + head) a fetch reply scattered into the mirrors: copied into the device K
        and V, then LOCAL in `table` and in the landing mask."""
        heads = table.num_heads
        where = (layer, slot, entries // heads, entries % heads)
        self._copy(where, k, v)
        table.values[where] = LOCAL
        self.landing.values[where] = LOCAL

    def _copy(self, where: Where, k: torch.Tensor, v: torch.Tensor) -> None:
        """Mirror rows -> device rows; returns once they are there, so a mask set after it never runs ahead of the
        data for a reader on another CUDA stream (the look-ahead's side stream)."""
        k[where] = self.k[where].to(k.device)
        v[where] = self.v[where].to(v.device)
        if k.device.type == "cuda":
            torch.cuda.current_stream(k.device).synchronize()

    def byte_views(self) -> dict[str, torch.Tensor]:
        """The regions a lane registers in place of the pool's K, V and mask."""
        return {
            "k": self.k.view(-1).view(torch.uint8),
            "v": self.v.view(-1).view(torch.uint8),
            "mask": self.landing.values.view(-1).view(torch.uint8),
        }
