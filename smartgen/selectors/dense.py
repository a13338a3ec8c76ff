"""The dense selector: every prompt token, the correctness reference."""

from __future__ import annotations

import torch

from smartgen.selectors.base import LayerMetadata, Selector, StepQuery, pad_rows


class DenseSelector(Selector):
    name = "dense"
    sparse = False

    def select(self, step: StepQuery, metadata: list[LayerMetadata]) -> torch.Tensor:
        heads = self.info.num_kv_heads
        return pad_rows([torch.arange(n).expand(heads, n) for n in step.prompt_lengths])
