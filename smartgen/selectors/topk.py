"""The exact top-k oracle: the prompt tokens with the highest true attention, per KV head.

It keeps every post-RoPE prompt key as metadata, so it is an upper bound on what any
sparse selector can pick for the same budget, not something to ship between nodes.

GQA: a KV head serves G query heads. A token's score for the KV head is the **max** over
those G heads of the softmax-normalised attention probability. Softmax first, because raw
logits of different query heads live on different scales, and the probability is what
weights the token's value in the output. Max rather than sum: a token that one head
attends to sharply must survive even if the other heads ignore it.
"""

from __future__ import annotations

import torch

from smartgen.selectors.base import LayerMetadata, ModelInfo, PrefillLayer, Selector, StepQuery, budget_tokens, pad_rows
from smartgen.selectors.budget_split import BudgetSplit

__all__ = ["ExactTopKSelector", "kv_head_scores"]


def kv_head_scores(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Per KV head, the max over its query heads of the attention probability of each token.

    query [Hq, d] post-RoPE, keys [H, n, d] post-RoPE -> [H, n] float32.
    """
    heads, _, dim = keys.shape
    group = query.shape[0] // heads
    q = query.float().reshape(heads, group, dim)  # [H, G, d]
    logits = torch.einsum("hgd,hnd->hgn", q, keys.float()) * dim**-0.5  # [H, G, n]
    return logits.softmax(dim=-1).amax(dim=1)


class ExactTopKSelector(Selector):
    """Oracle: top budget_tokens(budget, n) prompt tokens by true attention, per KV head."""

    name = "topk"

    def __init__(
        self,
        info: ModelInfo,
        budget: float = 0.1,
        head_split: str = "even",
        layer_split: str = "even",
        slope: float = 0.5,
        floor: float = 0.2,
    ) -> None:
        """`head_split`, `layer_split`, `slope`, `floor`: how the budget spreads over KV heads and layers
        (budget_split): the oracle under each split bounds what a selector with that split can keep."""
        super().__init__(info)
        budget_tokens(budget, 1)  # rejects a non-positive budget at construction, not mid-decode
        self.split = BudgetSplit.checked("topk", head_split, layer_split, slope, floor)
        self.budget = budget

    def build_metadata(self, prefill: PrefillLayer) -> LayerMetadata:
        # contiguous() so the metadata does not pin a larger captured buffer it is a view of
        return {"keys": prefill.key.contiguous()}  # [H, n, d]

    def select(self, step: StepQuery, metadata: list[LayerMetadata]) -> torch.Tensor:
        if step.query is None:
            raise ValueError("ExactTopKSelector needs this layer's query (StepQuery.query)")
        rows = []
        for b, n in enumerate(step.prompt_lengths):
            keys = metadata[b]["keys"][:, :n]  # [H, n, d]
            scores = kv_head_scores(step.query[b], keys)  # [H, n]
            budget = self.split.budget(self.budget, step.layer, self.info.num_layers)
            # ascending positions keep gathers and transfers as contiguous as the choice allows
            rows.append(self.split.rows(scores, budget_tokens(budget, n)))
        return pad_rows(rows)  # [B·H, max k]
