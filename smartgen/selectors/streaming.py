"""StreamingLLM's window as a selector: the first `sinks` prompt tokens plus the most recent ones.

StreamingLLM (REFERENCE.md section 4) keeps [0, start) + [n - recent, n). Here the window has the
budget of the other selectors: budget_tokens(budget, n) tokens in all, `sinks` of them at the start
(fewer when the budget is smaller), the rest the most recent prompt tokens. Generated tokens are
attended by the runtime anyway, so the window never slides during decoding. Every KV head gets
the same rows; no metadata, no selection cost.
"""

from __future__ import annotations

import torch

from smartgen.selectors.base import LayerMetadata, ModelInfo, Selector, StepQuery, budget_tokens, pad_rows

__all__ = ["StreamingSelector", "streaming_window"]


def streaming_window(length: int, budget: float, sinks: int) -> torch.Tensor:
    """Ascending prompt positions [k] of the window for a prompt of `length` tokens."""
    total = budget_tokens(budget, length)
    start = min(sinks, total)
    recent = total - start
    return torch.cat([torch.arange(start), torch.arange(length - recent, length)])


class StreamingSelector(Selector):
    """Attention sinks + recent window with `budget` tokens in all (a ratio <= 1 or a count > 1)."""

    name = "streaming"

    def __init__(self, info: ModelInfo, budget: float = 0.1, sinks: int = 4) -> None:
        super().__init__(info)
        budget_tokens(budget, 1)  # rejects a non-positive budget at construction
        if sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {sinks}")
        self.budget = budget
        self.sinks = sinks

    def select(self, step: StepQuery, metadata: list[LayerMetadata]) -> torch.Tensor:
        heads = self.info.num_kv_heads
        rows = [streaming_window(n, self.budget, self.sinks).expand(heads, -1) for n in step.prompt_lengths]
        return pad_rows(rows)  # [B·H, max k]
