"""The decode side's pure per-step decisions: what a request fetches, prefetches, hints and notices."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from smartgen.engine.index_ops import IndexSplit, distinct_in_order
from smartgen.engine.mask import REMOTE
from smartgen.engine.policy import Policy

__all__ = [
    "CHAINED_NOTICE_LAYERS",
    "DecodeFlags",
    "Notice",
    "AssemblyPlan",
    "plan_notice",
    "plan_assembly",
    "drop_remote_rows",
    "remote_entries",
    "forecast_chunk",
    "hinted",
    "hint_ratio",
    "prefetches",
    "prefetch_layer",
]

# a policy that chains its speculative slices sends an idle notice (with the hints gathered since the last) at the
# start of every this many layers, not of every layer: the chain, not the notices, keeps its link busy
CHAINED_NOTICE_LAYERS = 4

# link time of one forecast FETCH's reply: a running request's fetch reply waits behind at most one (`forecast_chunk`)
FORECAST_CHUNK_S = 0.005
# a forecast FETCH's reply bytes where the link's rate is not known (no pacing): about 0.3 ms of a 25 Gbit/s link
FORECAST_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class DecodeFlags:
    """The policy flags the decode side decides by, read once when a request opens (`of`)."""

    parallel: bool = True  # local entries are gathered while the remote ones are fetched (else after they land)
    speculative: bool = False  # idle notices ask for speculative pushes; RELEASE once every block is local
    chain: bool = False  # the prefill node chains its slices: a notice every CHAINED_NOTICE_LAYERS layers is enough
    drop_remote: bool = False  # remote entries are padding: never fetched, never attended (proactive-only)
    prefetch: bool = False  # a speculated selection's remote entries are fetched a layer ahead
    hints: float = 0.0  # (1 + hints) x the budget is ranked; its remote entries are hinted on the next notice
    quantized: bool = False  # full transfer in quantized layers, dequantized into the pool as they arrive
    attend_remote: bool = False  # remote picks are attended on the prefill node (ATTEND), not fetched

    def __post_init__(self) -> None:
        if self.hints < 0 or (self.hints and not self.speculative):
            raise ValueError(f"hints must be >= 0 and need speculation, got {self.hints}")
        if self.chain and not self.speculative:
            raise ValueError("chained speculation needs speculation")
        if self.drop_remote and (self.prefetch or self.speculative):
            raise ValueError("a request that drops remote entries neither fetches nor pushes them")

    @classmethod
    def of(cls, policy: Policy) -> DecodeFlags:
        return cls(
            parallel=policy.parallel,
            speculative=policy.speculative,
            chain=policy.chain,
            drop_remote=policy.drop_remote,
            prefetch=policy.prefetch,
            hints=policy.hints,
            quantized=bool(policy.quantize_bits),
            attend_remote=policy.attend_remote,
        )


@dataclass(frozen=True, slots=True)
class Notice:
    """Whether the start of a layer sends a request's idle notice, and its count of layers begun since its last."""

    send: bool
    layers_since_notice: int

    def __post_init__(self) -> None:
        if self.layers_since_notice < 0 or (self.send and self.layers_since_notice != 1):
            raise ValueError(f"a notice restarts the count at 1, got send={self.send}, {self.layers_since_notice}")


def plan_notice(
    flags: DecodeFlags, *, live: bool, first_step: bool, fetch_in_flight: bool, layers_since_notice: int
) -> Notice:
    """The idle notice at the start of a layer (`live`: not released, failed or resuming). None in a request's first
    decode step: every byte on the link then is one its fetches (what TTST waits for) share (measured: +30 ms of
    wait on the 16-layer sample); none while a fetch of it is on the link (the link is not idle). A chaining
    policy keeps its link busy without notices, so it sends one every CHAINED_NOTICE_LAYERS layers (the first at
    once): each notice is a message the step thread hands to the lane's sender (py-spy: 5 ms a step at one per
    layer on 32 layers); its hints wait for the next."""
    if not flags.speculative or not live or first_step or fetch_in_flight:
        return Notice(False, layers_since_notice)
    if flags.chain and 0 < layers_since_notice < CHAINED_NOTICE_LAYERS:
        return Notice(False, layers_since_notice + 1)
    return Notice(True, 1)


def hint_ratio(flags: DecodeFlags, *, released: bool) -> float:
    """How much wider than its budget a request's selection ranks for hints (0: it hints nothing). A released
    request's KV is all local: the wider ranking and its mask lookups would cost step time for nothing."""
    return 0.0 if released else flags.hints


def prefetches(flags: DecodeFlags, *, first_step: bool, released: bool) -> bool:
    """Its policy prefetches and it is past its first decode step, where the link, not compute, is what the step
    waits for, and a wrong guess's bytes only delay it; a released request has nothing left to fetch."""
    return flags.prefetch and not first_step and not released


def prefetch_layer(layer: int, *, layer_has_remote: bool, remote_met_before: set[int] | None) -> bool:
    """Layer `layer` is worth a speculated selection: it still has remote entries, and last step's selection (or
    prefetch) of it met some (`remote_met_before`; None: no step yet). Once hints and speculation keep a layer's
    picks local, a prefetch finds nothing to fetch and its selector pass only takes the decode node's CPU from the
    step: on 32 layers (random weights, D = 0.15) ungated prefetch cost 14 ms of CPU a step and TBT 1.10x full's
    against 1.08x without it; gated, 1.08x, while it still runs where fetches do (the early steps, a link-bound
    model)."""
    return layer_has_remote and (remote_met_before is None or layer in remote_met_before)


def remote_entries(index: torch.Tensor, status: torch.Tensor, asked: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """The remote entries of one request's index rows (`index`, `status` [H, k], row h = KV head h) as flat ids
    token * H + head, sorted (token-major, on the CPU), less those already `asked` for: exactly what a FETCH
    moves (a head no query of the step selected is not moved)."""
    num_heads = index.shape[0]
    flat = index * num_heads + torch.arange(num_heads, device=status.device).unsqueeze(1)  # [H, k]
    entries = flat[status == REMOTE].unique().cpu()
    if asked:
        entries = entries[~torch.isin(entries, torch.cat(list(asked)))]
    return entries


def forecast_chunk(entry_bytes: int, link_rate: float | None) -> int:
    """Entries one forecast FETCH asks for (`entry_bytes`: one (token, head) entry's K and V): what the link moves in
    FORECAST_CHUNK_S at `link_rate` bytes/s (None: FORECAST_CHUNK_BYTES), at least one. A reply is sent whole, and
    a running request's step reply queued behind a joiner's forecast reply waits for all of it: one layer's picks
    in one reply (about 20 ms of link on random:32 at 25 Mbit/s, 30 of them in a row) held each running step 100-370
    ms longer while a joiner's forecast crossed (measured, batch 4); in 5 ms pieces the spikes went."""
    budget = FORECAST_CHUNK_BYTES if not link_rate else link_rate * FORECAST_CHUNK_S
    return max(1, int(budget // max(1, entry_bytes)))


def hinted(
    noted: Sequence[tuple[int, torch.Tensor]], masks: torch.Tensor, slot: int, length: int, kept: torch.Tensor | None
) -> torch.Tensor | None:
    """The distinct prompt entries, as flat ids (layer * length + token) * H + head, that a request's noted picks name
    and that are still REMOTE, then those of `kept` (ids reduced earlier) not among them; on the CPU; None when none.
    In the picks' column order: the rows' first entries of every noted layer and head, then their second, and so on,
    so where the rows are likeliest first (`Selector.select_with_next`) the whole notice is, and a prefill node
    that cannot push all of it before the next step pushes the likeliest part (`prefill.decide.take_hints`).
    Entries, not tokens: a pick names one KV head, and a hinted token pushed whole sent every head (on random:32's
    2 KV heads a token's picks named 1.01 heads, so half of the hint bytes were never asked for).
    `noted`: (layer, rows [H, k]) a wider selection's picks of the request, -1 padded (`DecodePath.hint`);
    `masks` [L, S, N, H]: every layer's mask, the request in `slot`, `length` prompt tokens. The status of every
    noted layer is read in one pass per row width, at the notice rather than at each layer: the hints of four layers
    cost about what one layer's did (a few tensor operations whatever their size), and a pick that landed since it
    was noted is no longer named."""
    num_slots, num_tokens, num_heads = masks.shape[1:]
    by_width: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for layer, rows in noted:
        by_width.setdefault(rows.shape[1], []).append((layer, rows))
    named: list[torch.Tensor] = []
    flat_masks = masks.view(-1)
    for group in by_width.values():
        rows = torch.stack([r for _, r in group]).to(masks.device)  # [P, H, k]
        layers = torch.tensor([layer for layer, _ in group], dtype=torch.int64, device=masks.device).view(-1, 1, 1)
        valid = (rows >= 0) & (rows < length)
        safe = rows.clamp(0, length - 1)
        heads = torch.arange(num_heads, device=masks.device).view(1, -1, 1)
        flat = ((layers * num_slots + slot) * num_tokens + safe) * num_heads + heads  # into [L, S, N, H]
        remote = valid & (flat_masks.index_select(0, flat.view(-1)).view(rows.shape) == REMOTE)
        ids = (layers * length + rows) * num_heads + heads
        named.append(ids.permute(2, 0, 1)[remote.permute(2, 0, 1)])  # column by column
    if kept is not None:
        named.append(kept)  # older than any noted pick: after them
    if not named:
        return None
    entries = torch.cat(named)
    # a row names each position once, and ids carry their layer and head: only a layer noted twice (a notice held
    # back over a step) or the kept ids can repeat one
    if kept is not None or len({layer for layer, _ in noted}) < len(noted):
        entries = distinct_in_order(entries)
    entries = entries.cpu()
    return entries if entries.numel() else None


def drop_remote_rows(split: IndexSplit, rows: torch.Tensor) -> IndexSplit:
    """Proactive-only rows (`rows` [R] bool): remote entries turn into padding (rows local-first), so they
    are never fetched or attended; the other rows are left as they are."""
    dropped = rows.unsqueeze(1) & (split.status == REMOTE)
    status = torch.where(dropped, torch.zeros_like(split.status), split.status)
    order = torch.sort(status.to(torch.int16), dim=1, descending=True, stable=True).indices
    keep = ~rows.unsqueeze(1)
    return IndexSplit(
        torch.where(keep, split.index, torch.gather(split.index, 1, order)),
        torch.where(keep, split.status, torch.gather(status, 1, order)),
        torch.where(rows, torch.zeros_like(split.num_remote), split.num_remote),
        split.num_local,
    )


@dataclass(frozen=True, slots=True)
class AssemblyPlan:
    """How one layer's selection for a batch is assembled. Row r holds its remote entries [0, num_remote[r]),
    then its local ones up to `num_valid[r]`, padding after; local entries [num_remote, early_stop) are gathered
    while the fetches are in flight, the rest [early_stop, num_valid) once they landed (`all_parallel`: none)."""

    split: IndexSplit  # [R, k] index and status, rows remote-first (dropped rows: local-first, remote as padding)
    dropped: torch.Tensor  # [R]: remote entries selected but dropped (never fetched, never attended)
    early_stop: torch.Tensor  # [R]
    all_parallel: bool

    def __post_init__(self) -> None:
        rows = self.split.num_remote.shape
        if self.split.num_local.shape != rows or self.dropped.shape != rows or self.early_stop.shape != rows:
            raise ValueError(f"num_local, dropped and early_stop must be {list(rows)}, one per index row")

    @property
    def num_valid(self) -> torch.Tensor:
        """[R] int32: entries [0, num_valid) of each row are real."""
        return self.split.num_remote + self.split.num_local


def plan_assembly(split: IndexSplit, *, drop: list[bool], parallel: list[bool]) -> AssemblyPlan:
    """The assembly of a layer's selection (`split` by the mask, H rows per request) from each request's own
    policy, never the batch's: a request whose `drop` is set (drop_remote, or one whose step is redone anyway)
    has its remote entries turned into padding while its neighbours' are fetched, and a `parallel` request
    gathers its local entries while its fetches are in flight, a sequential one after they land."""
    num_rows = split.num_remote.shape[0]
    if len(drop) != len(parallel) or (num_rows % len(drop) if drop else num_rows):
        raise ValueError(f"one drop and one parallel flag per request, got {len(drop)} and {len(parallel)}")
    num_heads = num_rows // len(drop) if drop else 0
    if not any(drop) and all(parallel):  # the common batch: nothing dropped, every local entry gathered early
        return AssemblyPlan(split, torch.zeros_like(split.num_remote), split.num_remote + split.num_local, True)
    device = split.num_remote.device
    drop_rows = torch.tensor(drop, dtype=torch.bool, device=device).repeat_interleave(num_heads)
    dropped = torch.zeros_like(split.num_remote)
    if any(drop):
        dropped = torch.where(drop_rows, split.num_remote, dropped)  # selected, never attended: not covered
        split = drop_remote_rows(split, drop_rows)
    parallel_rows = torch.tensor(parallel, dtype=torch.bool, device=device).repeat_interleave(num_heads)
    early_stop = torch.where(parallel_rows, split.num_remote + split.num_local, split.num_remote)
    return AssemblyPlan(split, dropped, early_stop, all(parallel))
