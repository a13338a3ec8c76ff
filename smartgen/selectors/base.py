"""The selector contract: per-layer metadata built at prefill, and per-step KV indices [B·H, k] on the decode node.

Selection is over a request's prompt tokens only: tokens generated on the decode node are
local and always attended, so metadata never changes after prefill. Layers 0 and 1 are
dense and never reach a selector. Every sparse selector takes its budget as a ratio of the
prompt (0 < budget <= 1) or a token count (budget > 1).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

__all__ = [
    "ModelInfo",
    "PrefillLayer",
    "StepQuery",
    "Selector",
    "budget_tokens",
    "pad_rows",
    "group_max_probability",
    "check_gqa",
    "FIRST_SPARSE_LAYER",
]

FIRST_SPARSE_LAYER = 2  # layers 0 and 1 are dense and never reach a selector (engine.layout.DENSE_LAYERS)

LayerMetadata = dict[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a selector may know about the model."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    model: torch.nn.Module | None = None  # the HF model, for selectors that read weights (InfiniGen)
    # rope(x [B, heads, T, d], positions [B, T]) -> x with rotary embedding applied (post-RoPE space)
    rope: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads


@dataclass(frozen=True, slots=True)
class PrefillLayer:
    """One layer of one request at prefill, as the attention hook sees it."""

    layer: int
    query: torch.Tensor  # [Hq, n, d] post-RoPE
    key: torch.Tensor  # [H, n, d] post-RoPE
    hidden: torch.Tensor | None  # [n, D] the layer's attention input (after its input norm), if captured


@dataclass(frozen=True, slots=True)
class StepQuery:
    """What a decode step offers a selector for one layer of a batch."""

    layer: int
    query: torch.Tensor | None  # [B, Hq, d] this layer's post-RoPE query (None when selecting ahead)
    hidden: torch.Tensor | None  # [B, D] attention input of the layer that selects (see Selector.lookahead)
    positions: torch.Tensor  # [B] int64 position of the token being decoded
    prompt_lengths: list[int]  # n_b per request


def budget_tokens(budget: float, length: int) -> int:
    """Tokens to select from a prompt of `length`: a ratio (<= 1) or a count (> 1), at least 1."""
    if budget <= 0:
        raise ValueError(f"selection budget must be positive, got {budget}")
    count = round(budget * length) if budget <= 1 else int(budget)
    return max(1, min(length, count))


def group_max_probability(logits: torch.Tensor) -> torch.Tensor:
    """GQA rule "max": per query head a softmax over the prompt, then the max over the KV head's G query heads.

    logits [H, G, n] (each head's estimate of its attention logits, scaled) -> [H, n] float32. The exact
    top-k's rule (topk.kv_head_scores): a token one head needs sharply outranks tokens that several diffuse
    heads share, and heads whose logits live on larger scales do not drown the others.
    """
    return logits.float().softmax(dim=-1).amax(dim=1)


def check_gqa(name: str, gqa: str, choices: tuple[str, ...]) -> str:
    """`gqa` if it is one of `choices`, else a one-line ValueError."""
    if gqa not in choices:
        raise ValueError(f"{name}: gqa must be one of {', '.join(choices)}, got {gqa!r}")
    return gqa


def pad_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """Stacks per-request [H, k_b] index rows into [B·H, max k_b], padding with -1."""
    width = max(r.shape[1] for r in rows)
    heads = rows[0].shape[0]
    out = torch.full((len(rows) * heads, width), -1, dtype=torch.int64, device=rows[0].device)
    for b, r in enumerate(rows):
        out[b * heads : (b + 1) * heads, : r.shape[1]] = r
    return out


class Selector(ABC):
    """Picks the prompt KV entries a decode step attends to, per (batch, KV head) row."""

    name: str = "selector"
    # True: `select` for layer l+1 uses layer l's attention input (`StepQuery.hidden`), so the
    # runtime can fetch layer l+1's KV while layer l's FFN runs (InfiniGen). False: `select`
    # for layer l needs layer l's own query.
    lookahead: bool = False
    # True: `build_metadata` reads every prompt token's query (InfiniGen picks its columns from them), so a
    # prefill that reuses a cached prefix, whose queries are never computed, would give other metadata:
    # the prefill node's prefix cache stays out of the way for such a selector.
    reads_prefill_queries: bool = False
    # What the selector learns before it can run, as the constructor parameter that takes it (never stored among a
    # profile's parameters): "weights" trained once per model and kept in the profile store (`needs_training`:
    # HATA's hash weights, made by `smartgen profile --selector <name>`), or "skew" computed from one warm-up prompt
    # (`needs_warmup`: InfiniGen's offline skewing). None: nothing learned.
    learned_param: ClassVar[str | None] = None
    needs_training: ClassVar[bool] = False
    needs_warmup: ClassVar[bool] = False
    # False: the selector picks every token (dense): nothing to profile, no budget
    sparse: ClassVar[bool] = True

    def __init__(self, info: ModelInfo) -> None:
        self.info = info

    def build_metadata(self, prefill: PrefillLayer) -> LayerMetadata:
        """Per-layer metadata for one request, computed on the prefill node; empty by default."""
        return {}

    def widened(self, factor: float) -> Selector | None:
        """This selector at (1 + factor) x its budget, for ranking what it would pick next (SmartGen's hints);
        None for a selector without a budget."""
        budget = getattr(self, "budget", None)
        if not isinstance(budget, float | int) or factor <= 0:
            return None
        wide = copy.copy(self)
        scaled = float(budget) * (1.0 + factor)
        wide.budget = min(1.0, scaled) if budget <= 1 else scaled  # type: ignore[attr-defined]  # a ratio, or tokens
        return wide

    def select_with_next(
        self, step: StepQuery, metadata: list[LayerMetadata], wide: Selector
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this selector's pick, what `wide` (this selector `widened`) picks beyond it), both [B·H, k] positions,
        -1 padded. Here two passes, and the second is `wide`'s whole pick: this pick's own entries in it are harmless
        where it is used (SmartGen's hints skip what is local by then). A selector that ranks once and cuts at two
        budgets overrides it (Quest): the entries past this budget only, likeliest first."""
        return self.select(step, metadata), wide.select(step, metadata)

    @abstractmethod
    def select(self, step: StepQuery, metadata: list[LayerMetadata]) -> torch.Tensor:
        """Index [B·H, k] of prompt positions (-1 = no entry) for layer `step.layer`.

        `metadata[b]` is what `build_metadata` returned for request b at this layer.
        """
