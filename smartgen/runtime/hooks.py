"""SmartGen's hook into transformers: a registered attention function and mask function, routed per thread.

Models are loaded with `attn_implementation="smartgen"`. Outside a SmartGen runner the
function is plain SDPA attention, so the model behaves like any HF model (and `generate`
works). Inside one, the runner installs a handler for the current thread (a ContextVar)
and every attention call of every layer goes to it: the prefill handler hands each layer's
K/V off to the engine, the decode handler attends over the selected local and remote KV.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, Protocol

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

__all__ = ["ATTENTION_NAME", "AttentionHandler", "register", "active_handler", "use_handler", "dense_attention"]

ATTENTION_NAME = "smartgen"


class AttentionHandler(Protocol):
    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]: ...


_ACTIVE: ContextVar[AttentionHandler | None] = ContextVar("smartgen_attention_handler", default=None)


def dense_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Ordinary attention (SDPA, or eager when the model soft-caps logits): out [B, q_len, Hq, d]."""
    if kwargs.get("softcap") is not None:
        from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

        return eager_attention_forward(module, query, key, value, _additive_mask(attention_mask, query, key), **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _additive_mask(mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """The mask eager attention adds to its logits: the mask interface gives booleans (True = attend), or None
    where SDPA would run causal by itself, which eager attention does not."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if mask is None:
        if q_len == 1:
            return None
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)[None, None]
    if mask.dtype != torch.bool:
        return mask
    blocked = torch.finfo(query.dtype).min
    return torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, blocked)


def _attention(module, query, key, value, attention_mask, **kwargs):
    handler = _ACTIVE.get()
    if handler is None:
        return dense_attention(module, query, key, value, attention_mask, **kwargs)
    return handler.attend(module, query, key, value, attention_mask, **kwargs)


def _mask(*args: Any, **kwargs: Any):
    # Decode steps attend over gathered rows whose validity the engine tracks; no 4D mask needed. A prefill
    # handler's one-token run after a cached prefix still needs one (a sliding window must not see it all).
    handler = _ACTIVE.get()
    if handler is not None and kwargs.get("q_length", 0) == 1 and not getattr(handler, "needs_mask", False):
        return None
    return sdpa_mask(*args, **kwargs)


_registered = False


def register() -> None:
    """Registers the attention and mask functions under "smartgen" (idempotent)."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, _attention)
        AttentionMaskInterface.register(ATTENTION_NAME, _mask)
        _registered = True


def active_handler() -> AttentionHandler | None:
    return _ACTIVE.get()


@contextlib.contextmanager
def use_handler(handler: AttentionHandler) -> Iterator[None]:
    """Routes this thread's attention calls to `handler` for the duration of the block."""
    token = _ACTIVE.set(handler)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
