"""Loads Hugging Face causal LMs for SmartGen and reads what the engine needs from them (layout, layer kinds, RoPE)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from smartgen.engine.layout import DEFAULT_NUM_BLOCKS, KVLayout
from smartgen.runtime.hooks import ATTENTION_NAME, register
from smartgen.selectors.base import ModelInfo

__all__ = [
    "TESTED_MODEL_TYPES",
    "check_runnable",
    "check_config_runnable",
    "check_device",
    "ModelLoadError",
    "LayerKinds",
    "load_model",
    "model_from_config",
    "layer_kinds",
    "model_info",
    "kv_layout",
]

# Families tested against transformers' own generate (tests/test_runtime.py). Others pass if they have
# what the runtime needs (`check_runnable`); these names are only what we have tried.
TESTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "phi3", "gemma2", "granite", "olmo2")

_CONFIG_FIELDS = ("num_hidden_layers", "num_attention_heads", "hidden_size")


class ModelLoadError(RuntimeError):
    """The model cannot be loaded or is not one SmartGen supports; the message says why."""


def _check_config(config: PretrainedConfig) -> None:
    """What the runtime reads from a config: layer and head counts and the attention layout."""
    missing = [name for name in _CONFIG_FIELDS if getattr(config, name, None) is None]
    if missing:
        raise ModelLoadError(
            f"model type {config.model_type!r} is not supported: its config has no {', '.join(missing)}"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ModelLoadError(f"model type {config.model_type!r} is an encoder-decoder; SmartGen runs decoder-only LMs")


def check_runnable(model: torch.nn.Module) -> None:
    """Refuses, with the reason, a model the runtime cannot drive: the capability check every entry path runs.

    Needs: a decoder-only causal LM whose layers sit at `model.model.layers`, each attending
    through transformers' attention interface (`self_attn` with q/k/v projections or Phi-3's
    fused one), a rotary embedding at `model.model.rotary_emb`, GQA head counts in the config,
    and the model loaded with `attn_implementation="smartgen"` (what `load_model` does):
    under sdpa or eager the hook never runs, so the engine would see no KV.
    """
    _check_structure(model)
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation != ATTENTION_NAME:
        raise ModelLoadError(
            f"the model attends with {implementation!r}, not through SmartGen's hook: load it with "
            "smartgen.runtime.models.load_model (or from_pretrained(..., attn_implementation='smartgen') after "
            "smartgen.runtime.hooks.register())"
        )


def check_config_runnable(config: PretrainedConfig) -> None:
    """Refuses, with the reason, a config whose model the runtime could not drive, before any weight is made: its
    family's modules are built on the meta device (no memory, no weights) under eager attention, which every family
    has, and checked as `check_runnable` checks a model. A family that knows no registered attention function
    (Falcon, GPT-NeoX) is refused here rather than failing inside transformers."""
    _check_config(config)
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    except (ValueError, KeyError, TypeError, AttributeError, ImportError) as exc:
        raise ModelLoadError(
            f"model type {config.model_type!r} is not supported: transformers cannot build it ({exc})"
        ) from exc
    _check_structure(skeleton)


def _check_structure(model: torch.nn.Module) -> None:
    """What `check_runnable` asks of a model's modules, whatever its attention implementation."""
    config = getattr(model, "config", None)
    if config is None:
        raise ModelLoadError(f"{type(model).__name__} is not a transformers model (no config)")
    _check_config(config)
    name = f"model type {config.model_type!r}"
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) != config.num_hidden_layers:
        raise ModelLoadError(f"{name} is not supported: its decoder layers are not at model.model.layers")
    attn = getattr(layers[0], "self_attn", None)
    if attn is None or not (all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj")) or hasattr(attn, "qkv_proj")):
        raise ModelLoadError(f"{name} is not supported: its attention has no q/k/v projections SmartGen can read")
    if getattr(model.model, "rotary_emb", None) is None:
        raise ModelLoadError(f"{name} is not supported: SmartGen needs a rotary position embedding (RoPE)")


def check_device(device: str | torch.device) -> torch.device:
    """`device` as a torch device, if this machine has it; a ModelLoadError saying why not otherwise."""
    try:
        found = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelLoadError(f"device {str(device)!r} is not a torch device (cpu, cuda, cuda:1, ...): {exc}") from None
    if found.type == "cuda":
        if not torch.cuda.is_available():
            build = f"torch {torch.__version__}" + (", a CPU build" if torch.version.cuda is None else "")
            raise ModelLoadError(f"device {str(device)!r}: this machine has no CUDA device ({build})")
        if found.index is not None and found.index >= torch.cuda.device_count():
            raise ModelLoadError(f"device {str(device)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif found.type != "cpu":
        raise ModelLoadError(f"device {str(device)!r}: SmartGen runs on cpu or cuda devices")
    return found


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> PreTrainedModel:
    """A causal LM from a local folder (no network), in eval mode, attending through SmartGen's hook."""
    check_device(device)
    register()
    folder = Path(path)
    if not folder.is_dir():
        raise ModelLoadError(f"no model folder at {folder}")
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        check_config_runnable(config)
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, attn_implementation=ATTENTION_NAME, local_files_only=True
        )
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load a model from {folder}: {exc}") from exc
    check_runnable(model)
    # transformers wraps PreTrainedModel.to in functools.wraps(Module.to); typeshed's _Wrapped is no descriptor,
    # so mypy binds `device` to `self`
    return model.to(device).eval()  # type: ignore[arg-type]


def model_from_config(config: PretrainedConfig, dtype: torch.dtype = torch.float32, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised model of a config (tests, benchmarks), attending through SmartGen's hook."""
    register()
    check_config_runnable(config)
    config._attn_implementation = ATTENTION_NAME
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION_NAME)
    check_runnable(model)
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
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
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
