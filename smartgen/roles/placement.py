"""Which prefill node prefills a request: least queued work, counting the prompt tokens it likely has cached.

The decode node chooses per request (`choose_prefill`, a pure function) from each live prefill
node's queued work, the prompt tokens of the requests it was sent and has not prefilled yet, and
from prefix-cache affinity: `PrefixAffinity` remembers which prefill nodes were recently sent
which prompt blocks (the prefix cache's chained block hashes), so a prompt whose leading blocks
one node has prefilled lately is likely cached there, and costs that node only the rest. A node's
cost for the request is its queued tokens plus the prompt tokens it would have to compute; the
cheapest wins, then the one with fewer requests, then the first listed. Affinity thus wins
while the node holding the prefix is not further behind than the prefix saves, and an idle node
takes the request otherwise. A guess, never a promise: a prefill node may have evicted the
blocks (then it prefills them, as any other node would).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["PrefillLoad", "PrefixAffinity", "choose_prefill", "DEFAULT_AFFINITY_BLOCKS"]

# prompt blocks remembered (about 1.3 MiB of keys and peers): with 16-token blocks, the last 1M prompt tokens sent
DEFAULT_AFFINITY_BLOCKS = 65536


@dataclass(frozen=True, slots=True)
class PrefillLoad:
    """One live prefill node as the choice sees it."""

    queued_tokens: int  # prompt tokens of requests sent there and not prefilled yet
    requests: int  # requests that use it (prefilling or decoding)
    cached_tokens: int = 0  # this prompt's leading tokens it likely holds in its prefix cache

    def cost(self, prompt_tokens: int) -> int:
        """Tokens it would prefill before this request's first token: its queue, then the uncached rest."""
        return self.queued_tokens + max(prompt_tokens - self.cached_tokens, 0)


def choose_prefill(loads: Sequence[PrefillLoad], prompt_tokens: int) -> int:
    """The index of the prefill node to send a request of `prompt_tokens` to (`loads` must not be empty)."""
    if not loads:
        raise ValueError("no prefill node to choose from")
    return min(range(len(loads)), key=lambda i: (loads[i].cost(prompt_tokens), loads[i].requests, i))


class PrefixAffinity:
    """Which prefill nodes (any hashable name) were recently sent which prompt blocks; bounded, least recent out."""

    def __init__(self, block_tokens: int, max_blocks: int = DEFAULT_AFFINITY_BLOCKS) -> None:
        if block_tokens < 1 or max_blocks < 1:
            raise ValueError("a prefix affinity needs blocks of at least one token and room for one")
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self._nodes: OrderedDict[bytes, set[Hashable]] = OrderedDict()  # least recently sent first
        self._lock = threading.Lock()

    def cached_tokens(self, keys: Sequence[bytes], node: Hashable) -> int:
        """How many leading tokens of a prompt with block `keys` (prefix_cache.block_hashes) `node` likely has.

        Keys are chained (key i covers blocks 0..i), so the deepest key sent to `node` says all before it were."""
        with self._lock:
            deepest = 0
            for i, key in enumerate(keys):
                nodes = self._nodes.get(key)
                if nodes is None:
                    break  # no node was sent this block, so none was sent a longer prefix
                if node in nodes:
                    deepest = i + 1
            return deepest * self.block_tokens

    def sent(self, keys: Sequence[bytes], node: Hashable) -> None:
        """A prompt with block `keys` goes to `node`, which will prefill (and may cache) all of them."""
        with self._lock:
            for key in keys:
                nodes = self._nodes.pop(key, None) or set()
                nodes.add(node)
                self._nodes[key] = nodes
            while len(self._nodes) > self.max_blocks:
                self._nodes.popitem(last=False)

    def forget(self, node: Hashable) -> None:
        """`node` was lost: whatever it cached may be gone (a restarted node starts empty)."""
        with self._lock:
            for key in [k for k, nodes in self._nodes.items() if node in nodes]:
                nodes = self._nodes[key]
                nodes.discard(node)
                if not nodes:
                    del self._nodes[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._nodes)
