"""The prefill node's planner: a stored profile when one matches, else the fallback strategy, with live timings.

T_p comes from the profile, or is measured on this node (a running mean of prefill seconds
per token); T_t from the profile, or from the configured link rate. With neither a link rate
nor a profile the link is treated as unlimited (every block goes proactively).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from smartgen.engine.layout import KVLayout
from smartgen.engine.planning import Planner, TransferPlan
from smartgen.lanes.rate import transfer_seconds

__all__ = ["ProfileMatch", "NodePlanner"]

log = logging.getLogger(__name__)

MIN_MEASURED_TOKENS = 64  # shorter prefills do not teach the per-token time (fixed overhead dominates)
PREFILL_DECAY = 0.8  # weight of the past in the measured prefill time per token


@dataclass(frozen=True, slots=True)
class ProfileMatch:
    importance: torch.Tensor  # [L, M]
    prefill_seconds_per_token: float
    transfer_seconds_per_token: float
    profile_id: int | None = None
    nearest: bool = False  # the request's length is outside the profile's range


class NodePlanner:
    """A TransferPlanner: picks the profile for each request's length, then plans."""

    def __init__(
        self,
        layout: KVLayout,
        lookup: Callable[[int], ProfileMatch | None] | None,
        fallback_strategy: str,
        link_gbps: float | None,
        prefill_seconds_per_token: float | None = None,
    ) -> None:
        """`prefill_seconds_per_token`: a fixed T_p per token instead of this node's measured one (tests whose
        answers depend on K_r, as proactive-only's do, need it not to follow the machine's load)."""
        self.layout = layout
        self.fixed_prefill = prefill_seconds_per_token
        self.lookup = lookup
        self.fallback_strategy = fallback_strategy
        self.link_seconds_per_token = transfer_seconds(layout.kv_bytes(1), link_gbps)
        self._prefill_seconds_per_token = prefill_seconds_per_token or 0.0
        self._measured_seconds = 0.0
        self._measured_tokens = 0.0
        self._metadata_bytes = 0.0  # selector metadata sent, decayed like the prefill times
        self._metadata_tokens = 0.0
        self._lock = threading.Lock()
        self._warned = False
        self.last_match: ProfileMatch | None = None

    def record_prefill(self, length: int, seconds: float) -> None:
        """This node's prefill time per token (for K_r), from the prefills it ran: a decayed, length-weighted
        mean, so one long prefill counts as much as its tokens. Prefills under MIN_MEASURED_TOKENS are left
        out: their time is mostly fixed overhead, and a 2-token warm-up once made every token look 100x
        dearer, so K_r covered every block and fetches re-sent what the pushes were still carrying."""
        if length < MIN_MEASURED_TOKENS or seconds <= 0 or self.fixed_prefill is not None:
            return
        with self._lock:
            self._measured_seconds = PREFILL_DECAY * self._measured_seconds + seconds
            self._measured_tokens = PREFILL_DECAY * self._measured_tokens + length
            self._prefill_seconds_per_token = self._measured_seconds / self._measured_tokens

    def record_metadata(self, length: int, num_bytes: int) -> None:
        """Selector metadata bytes one request sent for its `length`-token prompt. It goes on the control lane
        ahead of the pushes, so the link time it takes during prefill is not there for the proactive set: K_r
        leaves it out (at 16 layers Quest's page bounds take a quarter of what the link moves while a stall-4.7
        prefill runs, and a K_r blind to them planned pushes that were still on the link at the first step)."""
        if length <= 0 or num_bytes < 0:
            return
        with self._lock:
            self._metadata_bytes = PREFILL_DECAY * self._metadata_bytes + num_bytes
            self._metadata_tokens = PREFILL_DECAY * self._metadata_tokens + length

    def _reserved(self, transfer_seconds_per_token: float) -> float:
        """Link seconds per prompt token the metadata takes, at T_t seconds per token of KV."""
        with self._lock:
            per_token = self._metadata_bytes / self._metadata_tokens if self._metadata_tokens else 0.0
        kv = self.layout.kv_bytes(1)
        return per_token / kv * transfer_seconds_per_token if kv else 0.0

    @property
    def prefill_seconds_per_token(self) -> float:
        """The measured prefill time per token (0 until a long enough prefill ran here)."""
        with self._lock:
            return self._prefill_seconds_per_token

    def plan(
        self,
        length: int,
        mode: str,
        strategy: str,
        request_counts: torch.Tensor | None = None,
        *,
        computed: int | None = None,
        held: int = 0,
        backlog: float = 0.0,
    ) -> TransferPlan:
        """The request's plan (see `Planner.plan` for `computed`, `held` and `backlog`)."""
        match = self.lookup(length) if (self.lookup is not None and mode == "budget") else None
        self.last_match = match
        if match is not None:
            with self._lock:
                measured = self._prefill_seconds_per_token
            # this node's own prefill time, once it has one: the profile's was measured elsewhere or under other load
            planner = Planner(
                self.layout.num_layers,
                self.layout.num_blocks,
                match.importance,
                measured or match.prefill_seconds_per_token,
                match.transfer_seconds_per_token,
                reserved_seconds_per_token=self._reserved(match.transfer_seconds_per_token),
            )
            return planner.plan(length, mode, strategy, request_counts, computed=computed, held=held, backlog=backlog)
        if strategy == "profile":
            if not self._warned and mode == "budget":
                log.warning(
                    "no profile for this model: planning with the %r strategy (run `smartgen profile`)",
                    self.fallback_strategy,
                )
                self._warned = True
            strategy = self.fallback_strategy
        with self._lock:
            prefill = self._prefill_seconds_per_token
        planner = Planner(
            self.layout.num_layers,
            self.layout.num_blocks,
            None,
            prefill,
            self.link_seconds_per_token,
            reserved_seconds_per_token=self._reserved(self.link_seconds_per_token),
        )
        return planner.plan(length, mode, strategy, request_counts, computed=computed, held=held, backlog=backlog)
