"""The decode node's prefix cache takes a finished request's wholly local leading blocks even when the rest of its
prompt never arrived, and a later request with that prefix holds them with an unchanged answer."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_config

from smartgen.engine.decode.engine import DecodeEngine
from smartgen.engine.policy import get_policy
from smartgen.runtime.models import model_from_config
from smartgen.runtime.pipeline import InprocPipeline

L, M = 4, 8  # the tiny model's layers; KV blocks per layer: a 96-token prompt has 12 tokens per block
CACHE_BLOCK = 8
NEW_TOKENS = 4
# the profile ranks the leading blocks first in every layer (layer 2 before 3 at equal position), so the proactive
# set past layers 0-1 is the prompt's head: with K_r = 2M + 4, blocks 0 and 1 of layers 2 and 3, tokens [0, 24)
IMPORTANCE = torch.tensor([[(M - m) * 10 + (L - layer) for m in range(M)] for layer in range(L)], dtype=torch.float32)
TIMINGS = {"prefill_seconds_per_token": 1e-5, "transfer_seconds_per_token": 1.2e-5}  # K_r = M (L-1) p / t = 20


@pytest.fixture(scope="module")
def model():
    return model_from_config(tiny_config("llama"))


def _prompt() -> torch.Tensor:
    return torch.randint(3, 97, (96,), generator=torch.Generator().manual_seed(7))


def _pipeline(model, cache_bytes: int) -> InprocPipeline:
    # partial+profile: the proactive set, then exact on-demand fetches and no speculation, so a request ends with
    # its prompt partly local and answers as full attention would
    return InprocPipeline(
        model,
        get_policy("partial+profile"),
        "quest",
        {"budget": 0.25},
        importance=IMPORTANCE,
        num_blocks=M,
        decode_cache_bytes=cache_bytes,
        prefix_block_tokens=CACHE_BLOCK,
        **TIMINGS,
    )


def test_a_partly_local_request_caches_exactly_its_local_leading_blocks(model, monkeypatch):
    at_finish: list[tuple[int, bool]] = []  # per finished request: its local leading tokens, all of it local or not
    cache_prompt = DecodeEngine._cache_prompt

    def spy(self: DecodeEngine, request) -> None:
        masks = self.pool.masks
        at_finish.append(
            (masks.local_prefix(request.slot, request.length), masks.all_local(request.slot, request.length))
        )
        cache_prompt(self, request)

    monkeypatch.setattr(DecodeEngine, "_cache_prompt", spy)
    with _pipeline(model, 0) as pipeline:
        expected = [r.tokens for r in pipeline.generate([_prompt()], NEW_TOKENS)]
        expected += [r.tokens for r in pipeline.generate([_prompt()], NEW_TOKENS)]
    at_finish.clear()
    with _pipeline(model, 1 << 24) as pipeline:
        first = pipeline.generate([_prompt()], NEW_TOKENS)[0]
        cache = pipeline.decode_engine.prefix_cache.snapshot()
        second = pipeline.generate([_prompt()], NEW_TOKENS)[0]
    local, whole = at_finish[0]
    cached = local // CACHE_BLOCK * CACHE_BLOCK
    assert not whole and 24 <= local < 96  # the proactive head arrived, the rest never did
    assert cache["blocks"] == cached // CACHE_BLOCK and cache["inserted_blocks"] == cached // CACHE_BLOCK
    assert first.metrics.held_tokens == 0 and second.metrics.held_tokens == cached
    assert [first.tokens, second.tokens] == expected  # held blocks are the pushed KV: the answer does not change
