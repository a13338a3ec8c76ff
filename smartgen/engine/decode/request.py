"""A request on the decode node: its slot, link, policy flags and step state; the errors a request fails with."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from smartgen.engine import messages as msg
from smartgen.engine.decode.decide import DecodeFlags
from smartgen.engine.decode.progress import Arrival
from smartgen.engine.index_ops import IndexSplit
from smartgen.engine.metrics import RequestMetrics
from smartgen.engine.policy import Policy
from smartgen.lanes.link import LinkEnd

__all__ = ["DecodeRequest", "Assembled", "RequestFailed", "LinkLost", "LateFetch"]


class RequestFailed(RuntimeError):
    """A request could not go on: its prefill node failed it, went away, or timed out."""


class LinkLost(RequestFailed):
    """A fetch's prefill node went away (with `recompute` its request is opened again, not failed), or none is live."""


class Assembled(NamedTuple):
    """The selected KV of one layer for a batch: rows remote-first, padding last."""

    k: torch.Tensor  # [R, k, d]
    v: torch.Tensor  # [R, k, d]
    num_valid: torch.Tensor  # [R] int32: entries [0, num_valid) of each row are real
    split: IndexSplit
    # ATTENDs in flight: (batch member, its reply's future, when it was sent); those members' rows hold only what is
    # local, the rest comes as their partial attention (`DecodePath.land_attended`)
    attended: list[tuple[int, Future, float]] = []


class AttendAsk(NamedTuple):
    """What a layer's ATTENDs carry of the step: the query [B, Hq, d] (post-RoPE) and the attention's scale and
    softcap, as the model applies them."""

    query: torch.Tensor
    scale: float
    softcap: float | None = None


# a fetch in flight: (layer, flat (token, head) ids asked for, its reply's future, when it was sent)
LateFetch = tuple[int, torch.Tensor, Future, float]


@dataclass(slots=True)
class DecodeRequest:
    request_id: str
    slot: int
    length: int
    link: LinkEnd
    policy: Policy
    metrics: RequestMetrics
    fetch_counts: torch.Tensor  # [L, n, H] int32: how often each (token, KV head) entry was fetched
    first_token: Future = field(default_factory=Future)
    first_token_at: float | None = None  # time.monotonic() when FIRST_TOKEN arrived (the node's TTFT counts to it)
    metadata: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per layer, from METADATA messages
    released: bool = False
    open_message: msg.Open | None = None  # kept to open the request again elsewhere (recompute)
    # the lost link whose loss one thread took it over from (a listener and `open` may both see a link go; one acts)
    orphaned_from: LinkEnd | None = None
    # fetches a step gave up waiting for (stall_timeout), or prefetched: landed when they arrive
    late: list[LateFetch] = field(default_factory=list)
    deferred: bool = False  # this step waited too long for a fetch: its rows are padding, its step is redone
    # deferred because its fetches held the batch past its share of the step (`DecodePath.step_share`): it stays in
    # the batch and redoes the step in the next one (a stalled fetch parks its request outside the batch instead)
    held_back: bool = False
    step_wait_s: float = 0.0  # this step's waits for its fetches so far, its share of each wait it was part of
    # (layer, rows [H, k']) a wider selection's picks noted for the next IDLE (`decide.hinted` reads their status
    # then), and the tokens reduced from earlier notes while no notice went (`DecodePath.hint` keeps them bounded)
    hints: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    hints_kept: torch.Tensor | None = None
    # [L * n * H] bool: prompt entries ((layer * n + token) * H + head) some idle notice has hinted, to count the
    # fetches they missed
    hinted_sent: torch.Tensor | None = None
    deferred_since: float | None = None  # when the fetch it is waiting for was sent (fetch_timeout counts from it)
    # opened again after decoding began (recompute): the new node's FIRST_TOKEN says it has prefilled
    resume: Future | None = None
    overloaded: bool = False  # its prefill node refused it for lack of room (a 503 for the client, not a fault)
    lost: bool = False  # it failed because its prefill node was lost, and no other took it (a 503, not a fault)
    # per layer, whether any prompt entry was remote when this step first asked (None: not asked yet this step)
    remote_layers: list[bool] | None = None
    layers_since_notice: int = 0  # layers begun since its last idle notice (0: none sent yet)
    # layers whose selection (or prefetch) met remote entries this step, and last step's (None: no step yet)
    remote_met: set[int] = field(default_factory=set)
    remote_met_before: set[int] | None = None
    # this step's selection of each layer >= 2 ([H, k] index rows), counted once the step ends
    step_selections: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # what of its KV has arrived and when (the first-token bound judges this progress); the engine's open sets it
    arrival: Arrival = field(default_factory=lambda: Arrival(0, 0, 0.0))
    # the first step's forecast: FIRST_TOKEN promised one; its queries once FORECAST came (taken once, then None)
    forecast_promised: bool = False
    forecast: dict[int, torch.Tensor] | None = None
    forecast_taken: bool = False
    # the forecast step's token (the second) and the first token's K/V, as the FORECAST brought them, and when
    second: msg.SecondToken | None = None
    second_at: float = 0.0
    # a FORECAST that brought a second token promises the next step's queries (its step-2 FORECAST)
    forecast_next_promised: bool = False
    forecast_next: dict[int, torch.Tensor] | None = None
    # head-start tokens (Policy.head_start) as their FORECASTs brought them, in order, with their arrival, until taken
    head: list[tuple[msg.SecondToken, float]] = field(default_factory=list)
    head_done: bool = False  # the step-2 FORECAST came: no head-start token comes after it
    flags: DecodeFlags = field(init=False)  # the policy, read once

    def __post_init__(self) -> None:
        self.flags = DecodeFlags.of(self.policy)

    @property
    def resuming(self) -> bool:
        """Waiting for another prefill node to prefill it again: it must not step (nothing to fetch from yet)."""
        return self.resume is not None and not self.resume.done()

    @property
    def live(self) -> bool:
        """It may still ask its prefill node for something: not released, failed, or waiting to be prefilled again."""
        return not (self.released or self.metrics.error or self.resuming)
