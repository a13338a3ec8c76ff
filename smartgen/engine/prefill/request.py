"""A request on a prefill node: its store, plan, link and push state; the errors an OPEN or a message meets."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from smartgen.engine.planning import TransferPlan
from smartgen.engine.policy import Policy
from smartgen.engine.pool import PoolGeometry, RequestKV
from smartgen.engine.prefill.decide import PrefillFlags, speculative_order
from smartgen.engine.prefix_cache import PrefixHit
from smartgen.lanes.base import Completion
from smartgen.lanes.link import LinkEnd

__all__ = ["OpenedRequest", "RequestGone", "Overloaded"]


class RequestGone(KeyError):
    """A message for a request this node no longer holds (released, aborted, or never opened)."""


class Overloaded(ValueError):
    """An OPEN refused for lack of room (the queue or the store is full): the decode node answers 503."""


@dataclass(slots=True)
class OpenedRequest:
    """A request this prefill node is serving."""

    request_id: str
    slot: int
    length: int
    policy: Policy
    plan: TransferPlan
    link: LinkEnd
    geometry: PoolGeometry
    kv: RequestKV
    ones: torch.Tensor
    prompt: torch.Tensor | None = None  # token ids, when the decode node sent them (serving)
    held_prefix: int = 0  # leading tokens the decode node's prefix cache already holds: never pushed
    # [L, n, H] bool: (token, KV head) entries no push or fetch has sent yet (held ones are sent); a push sends
    # every head of a token, a fetch only the heads a step selected
    unsent: torch.Tensor | None = None
    # the link's rate as this request's proactive pushes measured it (bytes/s; 0 until one landed), and when the
    # last idle notice came: a speculative slice is sized to what the link moves between two notices
    link_rate: float = 0.0
    first_push: float | None = None
    pushed_bytes: int = 0
    last_idle: float | None = None
    fetched_since_idle: int = 0  # reply bytes this node sent the request's fetches since its last idle notice
    prefix_hit: PrefixHit | None = None  # this node's cached prefix, pinned while the request prefills
    sent: torch.Tensor | None = None  # [L, M_eff] bool: blocks pushed proactively (set by prefill_layer)
    spec_order: torch.Tensor | None = None  # flat ids still to push speculatively, made when speculation starts
    spec_cursor: int = 0
    spec_in_flight: Completion | None = None
    # flat ids (layer * length + token) the decode node's idle notices hinted at, one tensor per notice, newest
    # last: speculation pushes them, newest first, before the plan's speculative order
    hint_queue: list[torch.Tensor] = field(default_factory=list)
    pushes_in_flight: int = 0  # pushes posted and not yet landed (or failed): under the engine's lock
    held: torch.Tensor | None = None  # [L, n] bool: tokens the decode node already holds (never pushed)
    resumed: bool = False  # the decode node had decoded it already: no metadata, FIRST_TOKEN only says "ready"
    head_tokens: int = 0  # output tokens past the second this node may decode ahead (OPEN's, Policy.head_start)
    # the plan made before its K_r was deferred to a head start (Policy.defer_proactive): it stands again if a prompt
    # arrives mid-prefill, when no head start will follow
    deferred_plan: TransferPlan | None = None
    heading: bool = False  # this node is decoding it ahead of its decode node now (a head start)
    flags: PrefillFlags = field(init=False)  # the policy, read once

    def __post_init__(self) -> None:
        self.flags = PrefillFlags.of(self.policy)

    @property
    def speculation_done(self) -> bool:
        order = self.plan.speculative_order if self.spec_order is None else self.spec_order
        return self.spec_cursor >= order.numel()

    def speculative_order(self) -> torch.Tensor:
        """Every block not pushed yet (`decide.speculative_order`), made when speculation starts."""
        if self.spec_order is None:
            self.spec_order = speculative_order(self.plan, self.sent)
        return self.spec_order
