"""What a request must satisfy before the decode node takes it: checks that touch no node state.

Every refusal is a ServiceError with the HTTP status to use (400 bad input, 413 too long for the
model or a pool slot, 503 overloaded or no prefill node), raised before anything is queued or
allocated, so a refused request changes nothing on either node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smartgen.roles.service import GenerationParams, ServiceError

__all__ = ["RequestLimits", "check_request", "oracle_counts"]


@dataclass(frozen=True, slots=True)
class RequestLimits:
    vocab_size: int  # token ids must be in [0, vocab_size)
    context: int | None  # the model's max_position_embeddings (None: the model sets none)
    slot_tokens: int  # what one pool slot holds (prompt + output)

    @classmethod
    def of(cls, config: Any, slot_tokens: int) -> RequestLimits:
        """From a transformers config (text models nest it for multimodal ones)."""
        text = getattr(config, "text_config", None) or config
        context = getattr(text, "max_position_embeddings", None)
        return cls(int(text.vocab_size), int(context) if context else None, slot_tokens)


def check_request(prompt_ids: list[int], params: GenerationParams, limits: RequestLimits) -> None:
    """Raises ServiceError for a request the node must refuse; returns quietly otherwise."""
    if not prompt_ids:
        raise ServiceError("the prompt is empty")
    if params.max_tokens < 1:
        raise ServiceError("max_tokens must be at least 1")
    for name, ids in (("prompt", prompt_ids), ("stop_token_ids", params.stop_token_ids)):
        bad = next((t for t in ids if type(t) is not int or not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise ServiceError(f"{name}: token id {bad!r} is outside the vocabulary (0..{limits.vocab_size - 1})")
    total = len(prompt_ids) + params.max_tokens
    if limits.context is not None and total > limits.context:
        raise ServiceError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
            f"context of {limits.context} tokens",
            413,
        )
    if total > limits.slot_tokens:
        raise ServiceError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"{limits.slot_tokens} tokens a pool slot holds",
            413,
        )


def oracle_counts(counts: list[list[int]], num_layers: int, prompt_tokens: int) -> Any:
    """A request's `proactive_counts` ([layers][prompt tokens] of counts >= 0, as a recorded run's
    usage.selection_counts gives them) as an int32 tensor; a ServiceError (400) naming what is wrong otherwise."""
    import torch

    if len(counts) != num_layers or any(len(row) != prompt_tokens for row in counts):
        shape = f"{len(counts)} x {sorted({len(row) for row in counts})}"
        raise ServiceError(
            f"proactive_counts must be {num_layers} lists (one per layer) of {prompt_tokens} counts (one per prompt "
            f"token), got {shape}: send the usage.selection_counts of a run of this same prompt on this model"
        )
    tensor = torch.tensor(counts, dtype=torch.int64)
    if tensor.numel() and (int(tensor.min()) < 0 or int(tensor.max()) > 2**31 - 1):
        raise ServiceError("proactive_counts must hold counts between 0 and 2**31 - 1")
    return tensor.to(torch.int32)
