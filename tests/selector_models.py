"""A tiny random Llama attending through SmartGen's hook, for selector tests that run a model."""

from __future__ import annotations

from tiny_models import tiny_config


def hooked_tiny_llama(seed: int = 0):
    """(model, ModelInfo) of the tiny Llama config, eval mode, attention through the "smartgen" function."""
    from smartgen.runtime.hooks import register
    from smartgen.runtime.models import model_from_config, model_info

    register()
    config = tiny_config("llama")
    config._attn_implementation = "smartgen"
    model = model_from_config(config, seed=seed).eval()
    return model, model_info(model)
