"""The KV cache reaches the model under the name its transformers release takes (`cache`, or `past_key_values`
before 5.2x): a wrong name is ignored silently there, and the model then builds its own cache."""

from __future__ import annotations

import torch
from tiny_models import tiny_config
from transformers import DynamicCache

from smartgen.runtime.cache_kwarg import cache_kwarg, with_cache
from smartgen.runtime.models import model_from_config


class _New(torch.nn.Module):
    def forward(self, input_ids=None, cache=None, use_cache=None):
        return cache


class _Old(torch.nn.Module):
    def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
        return past_key_values


def test_the_name_is_the_one_forward_declares():
    assert cache_kwarg(_New()) == "cache"
    assert cache_kwarg(_Old()) == "past_key_values"
    marker = object()
    assert _New()(**with_cache(_New(), marker)) is marker
    assert _Old()(**with_cache(_Old(), marker)) is marker


def test_a_real_model_fills_the_cache_it_is_handed():
    tiny_llama = model_from_config(tiny_config("llama"))
    cache = DynamicCache()
    with torch.no_grad():
        tiny_llama(input_ids=torch.arange(3, 12)[None], **with_cache(tiny_llama, cache), use_cache=True)
    assert cache.get_seq_length() == 9
