"""Captures each attention layer's input hidden state (after its input norm) with forward pre-hooks.

InfiniGen-style selectors speculate layer l+1's selection from layer l's attention input;
transformers does not pass that to the attention function, so a pre-hook on every
`self_attn` module records it for the current thread's runner.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from transformers import PreTrainedModel

__all__ = ["HiddenCapture"]


class HiddenCapture:
    """Installs pre-hooks on a model's attention modules; `get(layer)` returns [B, T, D]."""

    def __init__(self, model: PreTrainedModel) -> None:
        self._local = threading.local()
        self._handles = []
        for layer, block in enumerate(model.model.layers):
            self._handles.append(block.self_attn.register_forward_pre_hook(self._hook(layer), with_kwargs=True))

    def _hook(self, layer: int):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            store = getattr(self._local, "store", None)
            if store is not None:
                store[layer] = hidden

        return hook

    def start(self) -> None:
        """Begins recording for this thread (each runner thread has its own record)."""
        self._local.store = {}

    def get(self, layer: int) -> torch.Tensor | None:
        store = getattr(self._local, "store", None)
        return None if store is None else store.get(layer)

    def stop(self) -> None:
        self._local.store = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
