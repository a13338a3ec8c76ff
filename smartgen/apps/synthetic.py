"""Synthetic KV caches and selector traces with real-LLM-like structure, for tests, benchmarks and the simulator.

A trace picks, per decode step, layer and KV head, k token positions: the attention sinks,
a recent window, and "hot" relative regions that are the same for every prompt of a layer
(the positional regularity a calibration profile captures), plus some random positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from smartgen.engine.layout import KVLayout

__all__ = ["SyntheticTrace", "synthetic_kv", "synthetic_new_token"]


def synthetic_kv(layout: KVLayout, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's prompt K and V, [L, n, H, d] each, deterministic in `seed`."""
    generator = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, length, layout.num_kv_heads, layout.head_dim)
    k = torch.randn(shape, generator=generator).to(layout.dtype)
    v = torch.randn(shape, generator=generator).to(layout.dtype)
    return k, v


def synthetic_new_token(layout: KVLayout, seed: int, step: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [H, d] of a generated token."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 997 + layer)
    shape = (layout.num_kv_heads, layout.head_dim)
    return torch.randn(shape, generator=generator).to(layout.dtype), torch.randn(shape, generator=generator).to(
        layout.dtype
    )


@dataclass(frozen=True, slots=True)
class SyntheticTrace:
    """A selector that picks `ratio` of the tokens per KV head with a structure shared across prompts."""

    num_layers: int
    num_kv_heads: int
    ratio: float = 0.1
    num_sinks: int = 4
    recent_share: float = 0.2  # of the budget
    hot_share: float = 0.6  # of the budget, from the layer's hot regions
    num_hot_regions: int = 6
    hot_width: float = 0.02  # relative width of a hot region
    model_seed: int = 1234  # fixes the hot regions: the "model"

    def budget(self, length: int) -> int:
        return max(1, min(length, round(self.ratio * length)))

    def hot_centres(self, layer: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.model_seed * 31 + layer)
        return torch.rand(self.num_hot_regions, generator=generator) * (1 - self.hot_width)

    def select(self, layer: int, length: int, context: int, seed: int) -> torch.Tensor:
        """Positions [H, k] (distinct per row) among `context` tokens, k = budget(length)."""
        k = min(self.budget(length), context)
        generator = torch.Generator().manual_seed(seed)
        rows = []
        centres = self.hot_centres(layer)
        for head in range(self.num_kv_heads):
            weights = torch.full((context,), 1e-3)
            weights[: min(self.num_sinks, context)] = 1e3
            recent = max(1, round(self.recent_share * k))
            weights[context - recent :] += 1e2
            positions = torch.arange(length, dtype=torch.float32) / length
            for c in centres:
                width = self.hot_width * (1 + 0.5 * head)
                inside = (positions >= c) & (positions < c + width)
                weights[:length][inside] += self.hot_share * 10
            rows.append(torch.multinomial(weights, k, replacement=False, generator=generator))
        return torch.stack(rows)

    def request_counts(self, length: int, steps: int, seed: int) -> torch.Tensor:
        """Selection counts [L, H, n] of one request over `steps` steps (prompt tokens only)."""
        counts = torch.zeros(self.num_layers, self.num_kv_heads, length)
        for step in range(steps):
            for layer in range(self.num_layers):
                index = self.select(layer, length, length, seed * 7919 + step * 131 + layer)
                counts[layer].scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
        return counts
