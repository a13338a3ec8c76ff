"""The name a model's forward takes its KV cache under: `cache` from transformers 5.2x, `past_key_values` before."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["cache_kwarg", "with_cache"]


@functools.cache
def _name_for(forward: Callable[..., Any]) -> str:
    # transformers renamed the argument (the old name is deprecated, then removed); an older release ignores an
    # unknown `cache=` silently and builds its own cache, so guessing wrong gives wrong tokens, not an error
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def cache_kwarg(model: torch.nn.Module) -> str:
    """`cache` or `past_key_values`: whichever `model.forward` declares."""
    return _name_for(type(model).forward)


def with_cache(model: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """The keyword argument that hands `cache` to `model`'s forward."""
    return {cache_kwarg(model): cache}
