"""Block importance, the proactive budget K_r, and the transfer plan (proactive set + speculative order).

Everything here is pure tensor arithmetic: the plan is decided apart from the lanes that
carry it, and is testable without a network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from smartgen.engine.layout import DENSE_LAYERS, block_bounds, effective_blocks, resample_importance, token_blocks

__all__ = [
    "ImportanceAccumulator",
    "proactive_budget",
    "TransferPlan",
    "plan_transfer",
    "defer_proactive",
    "STRATEGIES",
    "strategy_scores",
    "speculative_slice_size",
    "Planner",
    "TransferPlanner",
    "prefix_blocks",
]


class ImportanceAccumulator:
    """Accumulates per-entry selection counts into block importance I[l, m] over M relative blocks.

    I[l, m] is the mean selection count of the entries (token × KV head) that fall in
    relative block m of layer l, over every prompt added.
    """

    def __init__(self, num_layers: int, num_blocks: int) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.sums = torch.zeros(num_layers, num_blocks, dtype=torch.float64)
        self.entries = torch.zeros(num_blocks, dtype=torch.float64)
        self.num_prompts = 0

    def add(self, counts: torch.Tensor) -> None:
        """Adds one prompt's selection counts: [L, H, n] per entry (or [L, n], one head)."""
        if counts.dim() == 2:
            counts = counts.unsqueeze(1)
        num_layers, num_heads, length = counts.shape
        if num_layers != self.num_layers:
            raise ValueError(f"counts have {num_layers} layers, the accumulator {self.num_layers}")
        per_token = counts.double().sum(dim=1)  # [L, n]
        if length >= self.num_blocks:
            blocks = token_blocks(length, self.num_blocks)  # [n]
            self.sums.index_add_(1, blocks, per_token)
            self.entries += torch.bincount(blocks, minlength=self.num_blocks).double() * num_heads
        else:
            # Each token covers several relative blocks; each of them sees the token's entries.
            token_of_block = torch.arange(self.num_blocks) * length // self.num_blocks  # [M]
            self.sums += per_token[:, token_of_block]
            self.entries += num_heads
        self.num_prompts += 1

    def importance(self) -> torch.Tensor:
        """I[l, m] as float32 [L, M]; blocks no prompt reached are 0."""
        safe = torch.where(self.entries > 0, self.entries, torch.ones_like(self.entries))
        return (self.sums / safe).float()


def proactive_budget(
    num_layers: int, num_blocks: int, prefill_time: float, transfer_time: float, reserved_time: float = 0.0
) -> int:
    """K_r = clip(L·M · ((L-1)/L · T_p - T_m) / T_t, 2M, L·M): blocks the link moves while layers 1..L-1
    prefill, less `reserved_time` T_m the link spends on what goes ahead of the pushes (selector metadata)."""
    total = num_layers * num_blocks
    floor = DENSE_LAYERS * num_blocks
    if transfer_time <= 0:
        return total
    window = max((num_layers - 1) / num_layers * max(prefill_time, 0.0) - max(reserved_time, 0.0), 0.0)
    raw = total * window / transfer_time
    return int(min(max(math.floor(raw), floor), total))


def speculative_slice_size(total_blocks: int, ratio: float) -> int:
    """Blocks pushed per idle notice: a fixed fraction of all blocks, at least one."""
    if not 0 < ratio <= 1:
        raise ValueError(f"speculative ratio must be in (0, 1], got {ratio}")
    return max(1, math.ceil(ratio * total_blocks))


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """Which blocks of one request go proactively, and the order the rest go speculatively.

    Block ids are flat: layer · M_eff + block.
    """

    num_layers: int
    num_blocks: int  # M_eff of this request
    proactive: torch.Tensor  # [L, M_eff] bool
    speculative_order: torch.Tensor  # [L·M_eff − num_proactive] int64 flat ids, most important first

    def __post_init__(self) -> None:
        if self.proactive.shape != (self.num_layers, self.num_blocks):
            raise ValueError(
                f"proactive must be [{self.num_layers}, {self.num_blocks}], got {tuple(self.proactive.shape)}"
            )
        if self.num_proactive + self.speculative_order.numel() != self.num_layers * self.num_blocks:
            raise ValueError("proactive set and speculative order must partition the blocks")

    @property
    def num_proactive(self) -> int:
        return int(self.proactive.sum())

    def proactive_blocks(self, layer: int) -> torch.Tensor:
        """Ascending block ids of one layer to push right after that layer's prefill."""
        return self.proactive[layer].nonzero().flatten()


def _rank(scores: torch.Tensor) -> torch.Tensor:
    """Flat ids ordered by score, descending; ties go to the lower (layer, block) — deterministic."""
    return torch.sort(scores.flatten().double(), descending=True, stable=True).indices


def plan_transfer(scores: torch.Tensor, budget: int) -> TransferPlan:
    """Layers 0-1 whole plus the top (budget − 2·M_eff) blocks of layers >= 2 by score; the rest by score.

    `budget` is K_r: the total number of blocks sent proactively, layers 0-1 included.
    """
    num_layers, num_blocks = scores.shape
    total = num_layers * num_blocks
    budget = int(min(max(budget, DENSE_LAYERS * num_blocks), total))
    order = _rank(scores)
    always = order < DENSE_LAYERS * num_blocks
    rest = order[~always]
    chosen = rest[: budget - DENSE_LAYERS * num_blocks]
    proactive = torch.zeros(total, dtype=torch.bool)
    proactive[: DENSE_LAYERS * num_blocks] = True
    proactive[chosen] = True
    speculative = rest[budget - DENSE_LAYERS * num_blocks :]
    return TransferPlan(num_layers, num_blocks, proactive.view(num_layers, num_blocks), speculative)


def defer_proactive(plan: TransferPlan, keep_blocks: int = 0) -> TransferPlan:
    """`plan` with only layers 0-1 (and each layer's first `keep_blocks` blocks: a prefix the decode node holds)
    proactive; its other proactive blocks lead the speculative order, layer by layer, ahead of the rest."""
    proactive = plan.proactive.clone()
    proactive[DENSE_LAYERS:, keep_blocks:] = False
    deferred = (plan.proactive & ~proactive).flatten().nonzero().flatten()
    return TransferPlan(plan.num_layers, plan.num_blocks, proactive, torch.cat([deferred, plan.speculative_order]))


STRATEGIES = ("profile", "query", "random", "sequential", "streaming", "optimal")


def strategy_scores(
    strategy: str,
    num_layers: int,
    length: int,
    num_blocks: int,
    *,
    importance: torch.Tensor | None = None,
    request_counts: torch.Tensor | None = None,
    seed: int = 0,
    sink_tokens: int = 4,
) -> torch.Tensor:
    """Block scores [L, M_eff] under a proactive-set strategy; `plan_transfer` takes the top ones.

    - profile: the profile's importance [L, M], resampled to this request.
    - query: the profile's split of K_r over layers (an equal split without a profile); within each
      layer the prefill engine then picks the blocks the prompt's last query attends to most
      (`PrefillEngine.prefill_layer`'s `token_scores`), so these scores only decide the counts.
    - random: a seeded random order.
    - sequential: blocks in the order prefill produces them (layer, then position).
    - streaming: StreamingLLM — the blocks holding the first `sink_tokens` tokens, then the
      most recent blocks, the same number in every layer.
    - optimal: the blocks this request's selector really picks (`request_counts`, [L, H, n]).
    """
    m_eff = effective_blocks(length, num_blocks)
    if strategy == "profile":
        if importance is None:
            raise ValueError("the profile strategy needs a profile's importance matrix")
        if importance.shape[0] != num_layers:
            raise ValueError(f"profile has {importance.shape[0]} layers, the model {num_layers}")
        if importance.shape[1] != num_blocks:
            raise ValueError(f"profile has {importance.shape[1]} blocks per layer, the plan {num_blocks}")
        return resample_importance(importance.float(), length)
    if strategy == "query":
        if importance is not None and importance.shape == (num_layers, num_blocks):
            return resample_importance(importance.float(), length)
        # no profile: block m of every layer before block m + 1 of any, so every layer gets the same count
        return -torch.arange(m_eff, dtype=torch.float32).expand(num_layers, m_eff).clone()
    if strategy == "random":
        generator = torch.Generator().manual_seed(seed)
        return torch.rand(num_layers, m_eff, generator=generator)
    if strategy == "sequential":
        return -torch.arange(num_layers * m_eff, dtype=torch.float32).view(num_layers, m_eff)
    if strategy == "streaming":
        recency = torch.arange(m_eff, dtype=torch.float32)
        sink_blocks = int(token_blocks(length, num_blocks)[min(sink_tokens, length) - 1]) + 1
        recency[:sink_blocks] = float(m_eff + 1)
        return recency.expand(num_layers, m_eff).clone()
    if strategy == "optimal":
        if request_counts is None:
            raise ValueError("the optimal strategy needs the request's own selection counts")
        acc = ImportanceAccumulator(num_layers, m_eff)
        acc.add(request_counts)
        return acc.importance()
    raise ValueError(f"unknown proactive strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")


class TransferPlanner(Protocol):
    """What the prefill engine plans with: a Planner, or the prefill node's NodePlanner (profile per length)."""

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
    ) -> TransferPlan: ...


@dataclass(frozen=True, slots=True)
class Planner:
    """Makes each request's TransferPlan from a profile (or a strategy) and the link's timings.

    prefill_seconds / transfer_seconds are T_p and T_t for this length range (from the
    profile store, or measured); `plan` scales them to the request's length, since both
    grow with the number of tokens.
    """

    num_layers: int
    num_blocks: int
    importance: torch.Tensor | None = None
    prefill_seconds_per_token: float = 0.0
    transfer_seconds_per_token: float = 0.0
    seed: int = 0
    # link time per prompt token taken by what leaves ahead of the pushes (selector metadata on the control lane)
    reserved_seconds_per_token: float = 0.0

    def budget(self, length: int, mode: str, computed: int | None = None, backlog: float = 0.0) -> int:
        """K_r for a request: all blocks, just layers 0-1 ("floor"), or the formula ("budget").

        `computed`: the tokens prefill really computes (fewer than `length` after a prefix cache hit): T_p
        scales with them, T_t with the whole prompt. `backlog`: KV already on the link when the prefill starts
        (earlier requests' pushes, which go first), in tokens' worth of whole-model KV: the link spends
        T_t x backlog of the window on it.
        """
        m_eff = effective_blocks(length, self.num_blocks)
        if mode == "all":
            return self.num_layers * m_eff
        if mode == "floor":
            return DENSE_LAYERS * m_eff
        prefill_tokens = length if computed is None else computed
        return proactive_budget(
            self.num_layers,
            m_eff,
            self.prefill_seconds_per_token * prefill_tokens,
            self.transfer_seconds_per_token * length,
            self.reserved_seconds_per_token * length + self.transfer_seconds_per_token * max(backlog, 0.0),
        )

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
        """The request's plan; `computed` and `backlog` as in `budget`; `held`: leading tokens the decode node already
        holds, whose blocks cost the link nothing, so they join the proactive set on top of K_r (and are never
        speculated); the push skips their bytes."""
        if mode == "budget" and strategy == "profile" and self.importance is None:
            raise ValueError("no profile for this model: run `smartgen profile`, or choose another strategy")
        scores = (
            strategy_scores(
                strategy,
                self.num_layers,
                length,
                self.num_blocks,
                importance=self.importance,
                request_counts=request_counts,
                seed=self.seed,
            )
            if mode == "budget"
            else strategy_scores("sequential", self.num_layers, length, self.num_blocks)
        )
        budget = self.budget(length, mode, computed, backlog)
        covered = prefix_blocks(length, self.num_blocks, held)
        if covered:
            scores = scores.clone()
            scores[:, :covered] = float("inf")
            budget += (self.num_layers - DENSE_LAYERS) * covered
        return plan_transfer(scores, budget)


def prefix_blocks(length: int, num_blocks: int, held: int) -> int:
    """How many leading blocks of a `length`-token request lie wholly inside its first `held` tokens."""
    if held <= 0:
        return 0
    bounds = block_bounds(length, num_blocks)
    return int((bounds[1:] <= held).sum())
