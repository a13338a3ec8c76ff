"""Next-token choice: greedy by default, temperature and top-p sampling with a seed as options."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["Sampler"]


@dataclass(slots=True)
class Sampler:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    _generator: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self._generator = torch.Generator().manual_seed(self.seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> token ids [B] int64."""
        logits = logits.float().cpu()
        if self.temperature == 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits / self.temperature, dim=-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            keep = sorted_probs.cumsum(-1) - sorted_probs < self.top_p  # always keeps the top token
            sorted_probs = sorted_probs * keep
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        return torch.multinomial(probs, 1, generator=self._generator).squeeze(-1)
