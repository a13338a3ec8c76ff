"""How a selector spreads its budget: over a layer's KV heads (even, or Ada-KV's adaptive split) and over layers.

Both splits keep the total: the same KV bytes per decode step cross the link, only where they go changes.

- Heads, `head_split="adaptive"` (Ada-KV, Feng et al. 2024): a layer's H·k picks are the top H·k scores
  over all its KV heads at once, so a head whose attention is concentrated gives entries to a head whose
  attention is spread. Scores must be comparable across heads: the selectors' GQA rule "max" makes them
  probabilities. Every head first keeps its own top `floor` share (Ada-KV's safeguard), so no head is
  left without entries when one head's scores dominate.
- Layers, `layer_split="pyramid"` (PyramidKV, Cai et al. 2024): the budget of sparse layer l falls
  linearly from (1 + slope)·b at the first sparse layer to (1 - slope)·b at the last; the mean stays b.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from smartgen.selectors.base import FIRST_SPARSE_LAYER

__all__ = [
    "HEAD_SPLITS",
    "LAYER_SPLITS",
    "BudgetSplit",
    "layer_budget",
    "top_rows",
    "adaptive_order",
    "rows_from_flat",
]

HEAD_SPLITS = ("even", "adaptive")
LAYER_SPLITS = ("even", "pyramid")


@dataclass(frozen=True, slots=True)
class BudgetSplit:
    """A selector's split parameters, checked once; `budget` and `rows` apply them."""

    head_split: str = "even"
    layer_split: str = "even"
    slope: float = 0.5
    floor: float = 0.2

    @classmethod
    def checked(
        cls, name: str, head_split: str, layer_split: str, slope: float, floor: float, gqa: str = "max"
    ) -> BudgetSplit:
        """The split, or a one-line ValueError naming selector `name` for parameters a user got wrong."""
        if head_split not in HEAD_SPLITS:
            raise ValueError(f"{name}: head_split must be one of {', '.join(HEAD_SPLITS)}, got {head_split!r}")
        if layer_split not in LAYER_SPLITS:
            raise ValueError(f"{name}: layer_split must be one of {', '.join(LAYER_SPLITS)}, got {layer_split!r}")
        if not 0.0 <= slope < 1.0:
            raise ValueError(f"{name}: slope must be in [0, 1), got {slope}")
        if not 0.0 <= floor <= 1.0:
            raise ValueError(f"{name}: floor must be in [0, 1], got {floor}")
        if head_split == "adaptive" and gqa != "max":
            raise ValueError(f"{name}: head_split=adaptive compares scores across heads, so it needs gqa=max")
        return cls(head_split, layer_split, slope, floor)

    def budget(self, budget: float, layer: int, num_layers: int) -> float:
        """The budget of `layer` (`layer_budget`)."""
        return layer_budget(budget, layer, num_layers, self.layer_split, self.slope)

    def rows(self, scores: torch.Tensor, count: int) -> torch.Tensor:
        """The picks of scores [H, m] (`top_rows`)."""
        return top_rows(scores, count, self.head_split, self.floor)


def layer_budget(budget: float, layer: int, num_layers: int, layer_split: str, slope: float) -> float:
    """The budget (a ratio <= 1, or a token count > 1) of `layer` under the layer split."""
    sparse = num_layers - FIRST_SPARSE_LAYER
    if layer_split == "even" or sparse <= 1 or slope == 0.0:
        return budget
    position = (min(max(layer, FIRST_SPARSE_LAYER), num_layers - 1) - FIRST_SPARSE_LAYER) / (sparse - 1)
    scaled = budget * (1.0 + slope * (1.0 - 2.0 * position))
    return min(1.0, scaled) if budget <= 1 else max(1.0, scaled)


def adaptive_order(scores: torch.Tensor, count: int, floor: float) -> torch.Tensor:
    """Flat indices (head · m + position) of scores [H, m], best first: every head's top ceil(floor · count)
    first (ties by position), then the rest by score over all heads at once (ties by head, then position)."""
    m = scores.shape[1]
    reserve = min(m, math.ceil(floor * count - 1e-9)) if floor > 0 else 0
    keyed = scores.float().clone()
    if reserve:
        own = keyed.sort(dim=-1, descending=True, stable=True).indices[:, :reserve]
        keyed.scatter_(1, own, float("inf"))
    return keyed.flatten().sort(descending=True, stable=True).indices


def top_rows(scores: torch.Tensor, count: int, head_split: str = "even", floor: float = 0.2) -> torch.Tensor:
    """The picks of scores [H, m] as [H, k] ascending positions, -1 after a row's last pick.

    even: each head its top `count`. adaptive: H·count picks over all heads (`adaptive_order`), so rows
    differ in length; every row keeps at least ceil(floor · count)."""
    heads, m = scores.shape
    count = min(count, m)
    if head_split == "even":
        return scores.topk(count, dim=-1).indices.sort(dim=-1).values
    flat = adaptive_order(scores, count, floor)[: heads * count]
    return rows_from_flat(flat, heads, m)


def rows_from_flat(flat: torch.Tensor, heads: int, m: int) -> torch.Tensor:
    """Flat picks (head · m + position) -> [H, max picks per head] ascending positions, -1 padded."""
    flat = flat.sort().values  # by head, then position
    head, position = flat // m, flat % m
    counts = torch.bincount(head, minlength=heads)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(flat.numel(), device=flat.device) - starts[head]
    out = torch.full((heads, max(1, int(counts.max()))), -1, dtype=torch.int64, device=flat.device)
    out[head, rank] = position
    return out
