"""What a prefill node and a decode node must agree on before any KV moves: the model and the KV layout."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel

from smartgen.engine.layout import KVLayout
from smartgen.runtime.fingerprint import model_fingerprint

__all__ = ["node_identity"]


def node_identity(model: PreTrainedModel, layout: KVLayout, model_name: str) -> dict[str, Any]:
    """What both sides must agree on before any KV moves."""
    return {
        "fingerprint": model_fingerprint(model),
        "model": model_name,
        "layout": [
            layout.num_layers,
            layout.num_kv_heads,
            layout.head_dim,
            str(layout.dtype).removeprefix("torch."),
            layout.num_blocks,
        ],
    }
