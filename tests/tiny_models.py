"""Tiny configs of every supported model family, built locally (no downloads)."""

from __future__ import annotations

from transformers import (
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

COMMON = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, tie_word_embeddings=False,
)


def tiny_config(family: str):
    if family == "llama":
        return LlamaConfig(**COMMON, head_dim=16)
    if family == "qwen2":
        return Qwen2Config(**COMMON)
    if family == "qwen3":
        return Qwen3Config(**COMMON, head_dim=16)
    if family == "mistral":
        return MistralConfig(**COMMON, head_dim=16, sliding_window=None)
    if family == "gemma3":
        # explicit layer types: a tiny Gemma 3 otherwise gets no full-attention layer
        return Gemma3TextConfig(
            **COMMON, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        )
    if family == "phi3":
        return Phi3Config(**{**COMMON, "num_key_value_heads": 2}, pad_token_id=0, sliding_window=None)
    raise ValueError(family)


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3")
