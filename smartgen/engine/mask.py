"""Per-layer int8 KV masks on the decode node, one entry per token and KV head: 0 = padding, 1 = local, 2 = remote."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import NamedTuple

import torch

PAD = 0
LOCAL = 1
REMOTE = 2

__all__ = ["PAD", "LOCAL", "REMOTE", "MaskTable", "MaskSummary"]

# tokens a span scan reads first past a layer's local prefix; each further round reads twice as many, so finding the
# first non-local entry costs about its distance from the prefix, and a span that is local at once costs one round
SCAN_TOKENS = 64


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

    Because of that, "is this span local" is answered without reading the whole span each time: per layer and slot
    the table keeps how many leading prompt tokens it has seen all local (`local_below`), and a scan starts there,
    reading SCAN_TOKENS tokens, then twice as many, until it meets a non-local entry. A decode step's questions (is
    the request all local, which layers still have remote KV, are layers 0-1 in) then cost about the tokens that
    landed since the last question, not the context (at 32K tokens, 32 layers and 8 heads a full read is 8M entries,
    several ms a step). `open` and `close` reset the prefix; only prompt tokens count toward it (a generated token
    taken back, `DecodePool.drop_last`, is rewritten in place). Whoever writes a non-LOCAL value into a slot in use
    outside `open` and `close` must call `forget(slot)`.
    """

    def __init__(self, num_layers: int, num_slots: int, max_tokens: int, num_heads: int = 1) -> None:
        self.values = torch.zeros(num_layers, num_slots, max_tokens, num_heads, dtype=torch.int8)
        self._local_below = [[0] * num_slots for _ in range(num_layers)]  # [L][S]: tokens [0, w) seen all LOCAL
        self._prompt = [0] * num_slots  # prompt tokens of the request in each slot (the prefix stops there)
        self._epoch = [0] * num_slots  # bumped by open/close: a scan of a slot's last request writes no prefix
        self._lock = threading.Lock()

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
        self.forget(slot, length)
        self.values[:, slot, :length] = REMOTE
        self.values[:, slot, length:] = PAD

    def close(self, slot: int) -> None:
        self.forget(slot, 0)
        self.values[:, slot, :] = PAD

    def forget(self, slot: int, prompt_length: int | None = None) -> None:
        """Drops what the table has seen local of a slot (its next scans read from token 0); with `prompt_length`,
        the slot's prompt becomes that many tokens."""
        with self._lock:
            self._epoch[slot] += 1
            for row in self._local_below:
                row[slot] = 0
            if prompt_length is not None:
                self._prompt[slot] = prompt_length

    def local_below(self, layer: int, slot: int) -> int:
        """How many leading tokens of the slot's prompt in `layer` the table has seen local in every head."""
        return self._local_below[layer][slot]

    def span_local(self, layer: int, slot: int, start: int, stop: int) -> bool:
        """Whether every head of tokens [start, stop) of one layer is LOCAL."""
        return self.spans_local([layer], slot, start, stop)[0]

    def spans_local(
        self, layers: Sequence[int], slot: int, start: int, stop: int, *, all_of: bool = False
    ) -> list[bool]:
        """For each of `layers`: whether every head of tokens [start, stop) is LOCAL in it. A span starting inside
        the layer's local prefix is read from the prefix's end, and what the read finds local extends the prefix.
        `all_of`: only whether all are (the answer is then one bool, repeated): layers are read one at a time and
        the read stops at the first with a non-local entry."""
        if all_of:  # one layer at a time: a request still arriving has a non-local entry in one of its first layers
            whole = all(self.spans_local([layer], slot, start, stop)[0] for layer in layers)
            return [whole] * len(layers)
        answers: dict[int, bool] = {}
        with self._lock:
            epoch, prompt = self._epoch[slot], self._prompt[slot]
            begins = {layer: self._local_below[layer][slot] for layer in layers}
        pending: list[tuple[int, int, bool]] = []  # (layer, where its read goes on, whether it may grow the prefix)
        for layer in layers:
            prefix = begins[layer]
            if start <= prefix:
                if prefix >= stop:
                    answers[layer] = True
                else:
                    pending.append((layer, prefix, True))
            else:
                pending.append((layer, start, False))
        width = SCAN_TOKENS
        grown: dict[int, int] = {}
        while pending:
            firsts = self._first_nonlocal([p[0] for p in pending], slot, [p[1] for p in pending], stop, width)
            still: list[tuple[int, int, bool]] = []
            for (layer, begin, grows), first in zip(pending, firsts):
                end = min(begin + width, stop)
                if first < end:  # a non-local entry at `first`
                    answers[layer] = False
                    if grows:
                        grown[layer] = min(first, prompt)
                    continue
                if grows:
                    grown[layer] = min(end, prompt)
                if end >= stop:
                    answers[layer] = True
                else:
                    still.append((layer, end, grows))
            pending = still
            width *= 2
        if grown:
            with self._lock:
                if self._epoch[slot] == epoch:  # not closed or reopened while it read: the prefix is this request's
                    for layer, below in grown.items():
                        row = self._local_below[layer]
                        row[slot] = max(row[slot], below)
        return [answers[layer] for layer in layers]

    def _first_nonlocal(self, layers: list[int], slot: int, begins: list[int], stop: int, width: int) -> list[int]:
        """Per layer, the first token in [begin, min(begin + width, stop)) with a non-LOCAL head, or that range's end:
        one read of [len(layers), width, H] entries for all of them (a slice for one layer)."""
        if len(layers) == 1:
            at = begins[0]
            bad = (self.values[layers[0], slot, at : min(at + width, stop)] != LOCAL).any(dim=-1)
            return [at + (int(bad.to(torch.uint8).argmax()) if bool(bad.any()) else bad.numel())]
        _, num_slots, num_tokens, num_heads = self.values.shape
        device = self.values.device
        begin = torch.tensor(begins, dtype=torch.int64, device=device)
        inside = begin.unsqueeze(1) + torch.arange(width, device=device) < stop  # [P, width]
        # flat ids ((layer * S + slot) * N + token) * H + head of each layer's window, read in one index_select
        start = torch.tensor([(layer * num_slots + slot) * num_tokens * num_heads for layer in layers], device=device)
        flat = (start + begin * num_heads).unsqueeze(1) + torch.arange(width * num_heads, device=device)
        flat = flat.clamp_(max=self.values.numel() - 1).view(-1)  # past the table: outside the span, masked below
        window = self.values.view(-1).index_select(0, flat).view(len(layers), width, num_heads)
        bad = (window != LOCAL).any(dim=-1) & inside
        first = torch.where(bad.any(dim=1), bad.to(torch.uint8).argmax(dim=1), inside.sum(dim=1))
        return (begin + first).tolist()

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
        """Whether every head of tokens [0, length) is LOCAL in every layer (read from each layer's local prefix)."""
        if length <= 0:
            return True
        return self.spans_local(range(self.num_layers), slot, 0, length, all_of=True)[0]
