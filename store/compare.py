"""The positional-similarity check: how much two profiles' top-K_r block sets overlap (recall and Jaccard).

The sets are the blocks each profile would push proactively beyond layers 0 and 1 (those
always go whole, so counting them would only inflate the overlap): the top K_r − 2·M
blocks of layers >= 2, ranked and tie-broken exactly as `smartgen.engine.planning.plan_transfer`
ranks them for a request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from smartgen.engine.layout import DENSE_LAYERS
from smartgen.engine.planning import plan_transfer
from smartgen.store.profile import Profile

__all__ = ["Overlap", "compare", "top_blocks"]


def top_blocks(importance: torch.Tensor, k_r: int) -> set[int]:
    """Flat ids (layer · M + block) of the blocks beyond layers 0-1 that a budget of K_r pushes proactively."""
    plan = plan_transfer(importance, k_r)
    chosen = plan.proactive.clone()
    chosen[:DENSE_LAYERS] = False
    return set(chosen.flatten().nonzero().flatten().tolist())


@dataclass(frozen=True, slots=True)
class Overlap:
    """|A ∩ B| of two top-block sets; recall = |A ∩ B| / |B| (how much of b's set a's covers)."""

    k_r_a: int
    k_r_b: int
    num_a: int
    num_b: int
    num_common: int
    num_sparse_blocks: int  # blocks of layers >= 2: the most either set can hold

    @property
    def recall(self) -> float:
        return self.num_common / self.num_b if self.num_b else float("nan")

    @property
    def jaccard(self) -> float:
        union = self.num_a + self.num_b - self.num_common
        return self.num_common / union if union else float("nan")

    @property
    def covers_all(self) -> bool:
        """Both sets hold every block: the overlap is 1 whatever the profiles say."""
        return self.num_a == self.num_b == self.num_sparse_blocks

    @property
    def empty(self) -> bool:
        """A K_r at its floor (layers 0-1 only) leaves nothing to compare."""
        return self.num_a == 0 or self.num_b == 0


def compare(a: Profile, b: Profile, k_r: int | None = None) -> Overlap:
    """Overlap of a's and b's top-K_r sets; K_r is each profile's own (from its T_p, T_t) unless given."""
    if a.importance.shape != b.importance.shape:
        raise ValueError(
            f"profiles {a.id} and {b.id} have different shapes ({a.num_layers} x {a.num_blocks} vs "
            f"{b.num_layers} x {b.num_blocks}): profile them with the same model and --blocks"
        )
    k_a = a.k_r() if k_r is None else k_r
    k_b = b.k_r() if k_r is None else k_r
    set_a, set_b = top_blocks(a.importance, k_a), top_blocks(b.importance, k_b)
    sparse = (a.num_layers - DENSE_LAYERS) * a.num_blocks
    return Overlap(k_a, k_b, len(set_a), len(set_b), len(set_a & set_b), sparse)
