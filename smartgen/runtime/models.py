"""Loads Hugging Face causal LMs for SmartGen and reads what the engine needs from them (layout, layer kinds, RoPE)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from smartgen.layout import DEFAULT_NUM_BLOCKS, KVLayout
from smartgen.runtime.hooks import ATTENTION_NAME, register
from smartgen.selectors.base import ModelInfo

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ModelLoadError",
    "LayerKinds",
    "load_model",
    "model_from_config",
    "layer_kinds",
    "model_info",
    "kv_layout",
]

# Families with a standard attention module whose forward goes through transformers' attention interface.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "phi3")


class ModelLoadError(RuntimeError):
    """The model cannot be loaded or is not one SmartGen supports; the message says why."""


def _check_supported(config: PretrainedConfig) -> None:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"model type {config.model_type!r} is not supported; SmartGen runs {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> PreTrainedModel:
    """A causal LM from a local folder (no network), in eval mode, attending through SmartGen's hook."""
    register()
    folder = Path(path)
    if not folder.is_dir():
        raise ModelLoadError(f"no model folder at {folder}")
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        _check_supported(config)
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, attn_implementation=ATTENTION_NAME, local_files_only=True
        )
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load a model from {folder}: {exc}") from exc
    # transformers wraps PreTrainedModel.to in functools.wraps(Module.to); typeshed's _Wrapped is no descriptor,
    # so mypy binds `device` to `self`
    return model.to(device).eval()  # type: ignore[arg-type]


def model_from_config(config: PretrainedConfig, dtype: torch.dtype = torch.float32, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised model of a config (tests, benchmarks), attending through SmartGen's hook."""
    register()
    _check_supported(config)
    config._attn_implementation = ATTENTION_NAME
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION_NAME)
    return model.to(dtype).eval()


@dataclass(frozen=True, slots=True)
class LayerKinds:
    """Per layer: None for full attention (selection applies), or the sliding window it keeps."""

    windows: tuple[int | None, ...]

    def is_full(self, layer: int) -> bool:
        return self.windows[layer] is None


def layer_kinds(config: PretrainedConfig) -> LayerKinds:
    """Full-attention and sliding-window layers (Gemma 3 text interleaves them; Mistral may slide everywhere)."""
    num_layers = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is not None:
        return LayerKinds(tuple(window if t == "sliding_attention" else None for t in types))
    if config.model_type in ("mistral", "qwen2", "phi3") and window and getattr(config, "use_sliding_window", True):
        if config.model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
            return LayerKinds((None,) * num_layers)
        return LayerKinds((window,) * num_layers)
    return LayerKinds((None,) * num_layers)


def _decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    return model.model.layers


def model_info(model: PreTrainedModel) -> ModelInfo:
    """Shapes and the RoPE function a selector needs."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelInfo(
        num_layers=config.num_hidden_layers,
        num_q_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        hidden_size=config.hidden_size,
        model=model,
        rope=rope_function(model),
    )


def rope_function(model: PreTrainedModel) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """rope(x [B, heads, T, d], positions [B, T]) -> x rotated like the model's full-attention layers."""
    from smartgen.selectors.infinigen import rope_from_model

    return rope_from_model(model)


def kv_layout(
    model: PreTrainedModel, dtype: torch.dtype | None = None, num_blocks: int = DEFAULT_NUM_BLOCKS
) -> KVLayout:
    info = model_info(model)
    return KVLayout(info.num_layers, info.num_kv_heads, info.head_dim, dtype or model.dtype, num_blocks)
