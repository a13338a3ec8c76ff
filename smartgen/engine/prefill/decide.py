"""The prefill side's pure decisions: which blocks a layer pushes, and what each speculative slice pushes next."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from smartgen.engine.layout import DENSE_LAYERS, block_bounds, token_blocks
from smartgen.engine.planning import TransferPlan
from smartgen.engine.policy import Policy, ProactiveMode, Strategy

__all__ = [
    "RUN_COST_S",
    "MAX_HINT_NOTICES",
    "CHAIN_WINDOW_S",
    "PrefillFlags",
    "Bridge",
    "SpeculativeSlice",
    "query_blocks",
    "proactive_blocks",
    "push_path",
    "unsent_entries",
    "speculative_order",
    "slice_blocks",
    "next_slice",
    "pending_tokens",
    "block_pending",
    "hint_room",
    "take_hints",
    "entry_wants",
    "bridge",
    "bridge_tokens",
]

# what one more run of a push costs in descriptors (K, V and mask: 3 x about 9 us each on the TCP lane, the
# cheapest per descriptor; docs/lanes.md), against which a speculative push weighs resending a short gap
RUN_COST_S = 27e-6
# idle notices whose hints a request keeps queued; older ones are dropped (what they hinted has mostly been
# selected, and fetched, or has fallen out of the ranking since)
MAX_HINT_NOTICES = 64
# a chained speculative slice (`PrefillPath._chain`) is what the link moves in this long: small enough that the
# freshest hints go next, large enough that a slice is not mostly its descriptors
CHAIN_WINDOW_S = 0.01


@dataclass(frozen=True, slots=True)
class PrefillFlags:
    """The policy flags the prefill side decides by, read once when a request opens (`of`)."""

    speculative: bool = False  # idle notices (and landed slices, chained) push the next speculative slice
    chain: bool = False  # a landed speculative slice is followed by the next at once
    schedule: bool = False  # speculation waits for room on the link, in turn (`gate`)
    full: bool = False  # every block goes proactively: its pushes count as full transfer's, not a chosen set's
    query_pick: bool = False  # a layer's share of K_r goes to the blocks its last query attends to most
    quantized: bool = False  # full transfer in quantized layers, packed off the prefill thread
    drop_remote: bool = False  # the proactive set is all the decode node sees: it lands before FIRST_TOKEN
    replan_on_prefix: bool = False  # a prefix-cache hit plans again: K_r by the prefill time really spent
    defer_proactive: bool = False  # a request expected to be decoded here leaves its K_r to speculation
    speculative_ratio: float = 0.1  # the share of all blocks one speculative slice may push

    def __post_init__(self) -> None:
        if not 0 < self.speculative_ratio <= 1:
            raise ValueError(f"speculative ratio must be in (0, 1], got {self.speculative_ratio}")
        if self.chain and not self.speculative:
            raise ValueError("chained speculation needs speculation")
        if self.quantized and not self.full:
            raise ValueError("only full transfer can be quantized")
        if self.drop_remote and self.speculative:
            raise ValueError("a request that drops remote entries is never pushed them speculatively")

    @classmethod
    def of(cls, policy: Policy) -> PrefillFlags:
        # K_r only matters under a budget; the optimal strategy's counts were used up by the first plan; a
        # drop-remote policy's answers depend on its proactive set, which must not depend on the cache's state
        replan = (
            policy.proactive == ProactiveMode.BUDGET and policy.strategy != Strategy.OPTIMAL and not policy.drop_remote
        )
        return cls(
            speculative=policy.speculative,
            chain=policy.chain,
            schedule=policy.schedule,
            full=policy.proactive == ProactiveMode.ALL,
            query_pick=policy.strategy == Strategy.QUERY,
            quantized=bool(policy.quantize_bits),
            drop_remote=policy.drop_remote,
            replan_on_prefix=replan,
            defer_proactive=policy.defer_proactive and replan,
            speculative_ratio=policy.speculative_ratio,
        )


def query_blocks(token_scores: torch.Tensor, length: int, num_blocks: int, count: int) -> torch.Tensor:
    """The `count` blocks holding the highest token scores (a block scores its best token), ascending ids."""
    if count <= 0:
        return torch.zeros(0, dtype=torch.int64)
    blocks = token_blocks(length, num_blocks)
    m_eff = int(blocks[-1]) + 1
    best = torch.full((m_eff,), float("-inf")).scatter_reduce(0, blocks, token_scores.float().cpu(), "amax")
    return torch.sort(torch.topk(best, min(count, m_eff)).indices).values


def proactive_blocks(
    flags: PrefillFlags,
    planned: torch.Tensor,
    layer: int,
    length: int,
    num_blocks: int,
    *,
    token_scores: torch.Tensor | None = None,
    held_prefix: int = 0,
) -> torch.Tensor:
    """The blocks a prefilled layer pushes at once: the plan's (`planned`, ascending ids), or under the "query"
    strategy as many blocks picked by `token_scores` [n] (how much the prompt's last query attends to each token
    in this layer; layers 0-1 go whole). Held blocks cost nothing and fill their share of the pick first."""
    if token_scores is None or not flags.query_pick or layer < DENSE_LAYERS:
        return planned
    if held_prefix:
        token_scores = token_scores.clone()
        token_scores[:held_prefix] = float("inf")
    return query_blocks(token_scores, length, num_blocks, planned.numel())


def push_path(flags: PrefillFlags, tag: str) -> str:
    """The path a push's bytes count on: a full transfer's proactive pushes are "full", not a chosen set."""
    return "full" if tag == "proactive" and flags.full else tag


def unsent_entries(
    num_layers: int, length: int, num_heads: int, held: torch.Tensor | None, held_prefix: int
) -> torch.Tensor:
    """[L, n, H] bool: the entries a new request's decode node lacks (not in its prefix cache, not kept from a
    lost prefill node): every push and fetch clears what it sends, so nothing is sent twice."""
    unsent = (torch.arange(length) >= held_prefix).repeat(num_layers, 1)
    if held is not None:
        unsent &= ~held
    return unsent.unsqueeze(-1).repeat(1, 1, num_heads)


def speculative_order(plan: TransferPlan, sent: torch.Tensor | None) -> torch.Tensor:
    """Every block not pushed yet (`sent` [L, M_eff] bool; None: the plan's proactive set), as flat ids: the plan's
    proactive blocks a query pick replaced first, then the plan's speculative order."""
    ranking = torch.cat([plan.proactive.flatten().nonzero().flatten(), plan.speculative_order])
    done = sent.flatten() if sent is not None else plan.proactive.flatten()
    return ranking[~done[ranking]]


def slice_blocks(
    token_bytes: int, link_rate: float, window: float, pending_tokens: torch.Tensor, limit: int, fetched: int = 0
) -> int:
    """How many of the next blocks (their unsent token counts, in order) one speculative slice takes: what the
    link moves in one idle window (between two idle notices) at the rate the proactive pushes measured, at
    least one block, at most `limit` (the speculative ratio). A slice still on the link when the next fetch
    comes is sent twice for every token that fetch wants (fetches pre-empt pushes), so big slices cost bytes.
    Without a window yet (the first notice of a request's decoding: its first step is about to fetch what it
    lacks, and that fetch is what TTST waits for): one block. Without a measured rate yet: `limit`.
    `fetched`: reply bytes sent for the request's fetches in the window, link time that was not idle; when
    they took all of it, no block (0): speculation waits for a window the fetches leave free."""
    if window <= 0:
        return 1
    if link_rate <= 0:
        return limit
    budget = link_rate * window - fetched
    if fetched and budget <= 0:
        return 0
    cumulative = torch.cumsum(pending_tokens * 2 * token_bytes, 0)
    return max(1, min(limit, int((cumulative <= budget).sum())))


@dataclass(frozen=True, slots=True)
class SpeculativeSlice:
    """The next speculative slice of a request: flat block ids (layer * num_blocks + block), and how far along the
    speculative order it takes the cursor (blocks fetches already brought whole are passed over, not resent)."""

    ids: torch.Tensor  # [S] int64
    advance: int
    num_blocks: int  # M_eff of the request's plan

    def __post_init__(self) -> None:
        if self.ids.dim() != 1 or self.advance < self.ids.numel() or self.num_blocks <= 0:
            raise ValueError(f"a slice of {self.ids.numel()} blocks cannot move the cursor by {self.advance}")

    def layer_blocks(self) -> list[tuple[int, torch.Tensor]]:
        """Per layer, the block ids the slice pushes there."""
        layer_of = self.ids // self.num_blocks
        return [(int(layer), self.ids[layer_of == layer] % self.num_blocks) for layer in layer_of.unique()]


# blocks of the speculative order whose unsent tokens a slice looks up first; doubled until the slice is sized
SLICE_LOOKUP_BLOCKS = 64


def next_slice(
    ahead: torch.Tensor,
    *,
    size: int,
    num_blocks: int,
    pending: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None,
    link_rate: float,
    window: float,
    fetched: int,
    token_bytes: int,
) -> SpeculativeSlice | None:
    """The slice after the cursor (`ahead`: the speculative order from it), at most `size` blocks. `pending`
    (unsent tokens per block: a [L * num_blocks] tensor, or a function from block ids to theirs; None: not
    tracked) passes over blocks already sent whole and sizes the slice by what the link moves in the idle `window`
    (`slice_blocks`); None when that window went to fetches: nothing is idle to speculate with. Only as much of
    `ahead` is looked up as the slice needs: a slice is a few blocks, the order tens of thousands, and counting
    every block's unsent tokens took milliseconds a slice at 4K tokens (`block_pending`)."""
    if pending is None:
        ids = ahead[:size]
        return SpeculativeSlice(ids, ids.numel(), num_blocks)
    lookup = pending if callable(pending) else pending.__getitem__
    positions: list[torch.Tensor] = []  # in `ahead`, of the blocks with unsent tokens, in order
    tokens: list[torch.Tensor] = []
    start, chunk, count = 0, SLICE_LOOKUP_BLOCKS, 1
    while start < ahead.numel():
        found = lookup(ahead[start : start + chunk]).float()
        keep = found > 0
        positions.append(keep.nonzero().flatten() + start)
        tokens.append(found[keep])
        start, chunk = start + chunk, 2 * chunk
        kept = torch.cat(tokens)
        count = slice_blocks(token_bytes, link_rate, window, kept, size, fetched)
        if count < kept.numel() or kept.numel() >= size:
            break  # more blocks would not change the slice (the sizing is a prefix of them)
    found_any = any(p.numel() for p in positions)
    if found_any and count == 0:
        return None
    taken = torch.cat(positions)[:count] if positions else ahead[:0]
    advance = int(taken[-1]) + 1 if taken.numel() else ahead.numel()
    return SpeculativeSlice(ahead[taken], advance, num_blocks)


def pending_tokens(unsent: torch.Tensor, length: int, num_blocks: int, plan_blocks: int) -> torch.Tensor:
    """[L * plan_blocks] float: per block (of `num_blocks` over `length` tokens), its tokens not sent yet in some
    head (`unsent` [L, n, H] bool)."""
    blocks = token_blocks(length, num_blocks)
    pending = torch.zeros(unsent.shape[0], plan_blocks).index_add_(1, blocks, unsent.any(dim=-1).float())
    return pending.flatten()


@functools.lru_cache(maxsize=64)
def _block_token_grid(length: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's tokens as a padded grid: ([M_eff, W] token ids, clamped into the prompt; [M_eff, W] which are
    real), W the longest block. Shared between calls: never written to."""
    bounds = block_bounds(length, num_blocks)
    width = int((bounds[1:] - bounds[:-1]).max())
    grid = bounds[:-1].unsqueeze(1) + torch.arange(width)
    return grid.clamp(max=length - 1), grid < bounds[1:].unsqueeze(1)


def block_pending(unsent: torch.Tensor, length: int, num_blocks: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """`pending_tokens` for the blocks asked only (flat ids layer * M_eff + block -> their unsent token counts), read
    from `unsent` [L, n, H] as it is when asked: a slice looks up tens of blocks, not every block of the prompt."""
    grid, real = _block_token_grid(length, num_blocks)
    m_eff = grid.shape[0]
    rows = unsent.view(-1, unsent.shape[-1])  # [L * n, H]

    def pending(ids: torch.Tensor) -> torch.Tensor:
        blocks = ids % m_eff
        tokens = (ids // m_eff).unsqueeze(1) * length + grid[blocks]  # [K, W] rows of `rows`
        # index_select on the flat rows: 10-15 us on one thread (advanced indexing 7-26 us), and where torch runs a
        # thread pool whose other CPUs are busy it stayed at ~15 us while advanced indexing took ~4 ms (measured)
        heads = rows.index_select(0, tokens.flatten()).view(*tokens.shape, -1)
        return (heads.any(dim=-1) & real[blocks]).sum(dim=1)

    return pending


def hint_room(entry_bytes: int, link_rate: float, window: float, fetched: int) -> int | None:
    """How many hinted entries (`entry_bytes` of K, as many of V) one speculative push takes: what the link moves
    in the idle `window` less the `fetched` reply bytes (0: fetches took it all, push nothing); with no window yet
    (the first notice, which brings the hints the first step gathered: on 32 layers 1.5 MiB, half a second of
    link) one chained slice's worth; with no rate measured yet, None: the newest notice's hints, whole."""
    entry_cost = 2 * entry_bytes
    if window > 0 and link_rate > 0:
        budget = link_rate * window - fetched
        if fetched and budget <= 0:
            return 0
        return max(1, int(budget // entry_cost))
    return None if link_rate <= 0 else max(1, int(link_rate * CHAIN_WINDOW_S // entry_cost))


def take_hints(
    queue: list[torch.Tensor], unsent: torch.Tensor, room: int | None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Takes up to `room` hinted entries still unsent (`unsent`, flat like the ids, bool) from the hint queue, newest
    notice first and each notice from its front, where its likeliest entries are (`decode.decide.hinted`); None:
    the newest notice's, whole; returns them and what stays queued (a notice's rest stays newest, for the next
    window). A step's hints are what the next steps are likeliest to select, and a notice's hints grow stale as
    decoding moves on: pushing every notice's hints at once queued more bytes than the link moved between two
    steps, so the freshest waited behind the stale."""
    queue = list(queue)
    taken: list[torch.Tensor] = []
    while queue and (room is None or room > 0):
        ids = queue.pop()
        ids = ids[unsent[ids]]
        if room is not None and ids.numel() > room:
            queue.append(ids[room:])
            ids = ids[:room]
        taken.append(ids)
        if room is None:
            break
        room -= ids.numel()
    return (torch.cat(taken) if taken else torch.empty(0, dtype=torch.int64)), queue


def entry_wants(ids: torch.Tensor, num_layers: int, length: int, num_heads: int) -> list[tuple[int, torch.Tensor]]:
    """Flat entry ids ((layer * length + token) * H + head) as the [n, H] bool entries wanted in each layer that
    has any. The layers come from the ids, not from scanning the mask (a scan of every layer's entries took 1.2 ms
    a hinted slice at 32K tokens on one thread, the ids' own 0.2)."""
    want = torch.zeros(num_layers * length * num_heads, dtype=torch.bool)
    want[ids] = True
    want = want.view(num_layers, length, num_heads)
    return [(int(layer), want[layer]) for layer in torch.unique(ids // (length * num_heads))]


class Bridge(NamedTuple):
    """How a speculative push bridges gaps: runs of up to `tokens` already-sent tokens are sent again rather than
    split around, if `resendable` ([L, n, H] bool) says this node sent them (0, None: no bridging)."""

    tokens: int
    resendable: torch.Tensor | None


def bridge_tokens(token_bytes: int, link_rate: float) -> int:
    """The longest gap of already-sent tokens worth sending again (`bridge`): 0 on a link this slow (or unmeasured)."""
    return 0 if link_rate <= 0 else int(link_rate * RUN_COST_S / (2 * token_bytes))


def bridge(
    token_bytes: int, link_rate: float, unsent: torch.Tensor | None, held_prefix: int, held: torch.Tensor | None
) -> Bridge:
    """Longest gap of already-sent tokens a speculative run sends again rather than split around it: the bytes of
    a gap must cost the link less than the three descriptors (K, V, mask) splitting adds (RUN_COST_S), at the
    rate this request's pushes measured. On a slow link that is no token at all; on a fast one, fetched tokens
    scattered through a block range stop fragmenting it. Only entries this node sent in this request are resent
    (`unsent` [L, n, H] cleared, less the decode node's own prefix `held_prefix` and `held` [L, n]): their bytes
    are the ones the decode node holds."""
    tokens = bridge_tokens(token_bytes, link_rate)
    if unsent is None or tokens <= 0:
        return Bridge(0, None)
    resendable = ~unsent
    resendable[:, :held_prefix] = False
    if held is not None:
        resendable &= ~held[..., None]
    return Bridge(tokens, resendable)
