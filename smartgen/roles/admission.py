"""What a request must satisfy before the decode node takes it: checks that touch no node state.

Every refusal is a ServiceError with the HTTP status to use (400 bad input, 413 too long for the
model or a pool slot, 503 overloaded or no prefill node), raised before anything is queued or
allocated, so a refused request changes nothing on either node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smartgen.roles.service import GenerationParams, ServiceError

__all__ = ["RequestLimits", "check_request"]


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
