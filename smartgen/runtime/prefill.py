"""Prefill runner: runs a prompt through an HF causal LM and hands each layer's K/V and selector metadata off as soon as the layer is done.

The hand-off happens inside the attention call of each layer (the K/V are final by then),
so the engine can push a layer's planned blocks while later layers compute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from smartgen.engine.attention import sparse_decode_attention
from smartgen.engine.layout import DENSE_LAYERS
from smartgen.runtime.cache_kwarg import with_cache
from smartgen.runtime.capture import HiddenCapture
from smartgen.runtime.emulation import Emulation
from smartgen.runtime.hooks import dense_attention, use_handler
from smartgen.runtime.models import LayerKinds, check_runnable, layer_kinds
from smartgen.runtime.sampling import Sampler
from smartgen.selectors.base import PrefillLayer, Selector, StepQuery
from smartgen.selectors.dense import DenseSelector

__all__ = [
    "PrefillOutput",
    "Forecasted",
    "PrefillRunner",
    "StepYielded",
    "LayerSink",
    "capture_qk",
    "infinigen_skewing",
    "last_query_attention",
]


# on_layer(layer, k [n, H, d], v [n, H, d], metadata[, token_scores [n]]); what it returns is ignored.
# token_scores (a run with last_query_scores=True, layers >= 2): the last query's attention per token.
LayerSink = Callable[..., object]


@dataclass(slots=True)
class PrefillOutput:
    first_token: int
    logits: torch.Tensor  # [V] float32 at the last prompt position
    metadata: list[dict[str, torch.Tensor]]  # per layer; {} where the layer needs none
    cache: DynamicCache | None = None  # the prompt's K/V as HF keeps them (a run with keep_cache=True), for `forecast`
    length: int = 0  # prompt tokens


class StepYielded(Exception):
    """A head-start step gave way, between two layers, to a prompt waiting for prefill (`step_ahead`'s `yield_to`):
    the kept cache is as before the step, and nothing of it left."""


@dataclass(slots=True)
class Forecasted:
    """The first decode step, run on the prefill node (`PrefillRunner.forecast`)."""

    queries: dict[int, torch.Tensor]  # per layer a decode step selects in: the step's post-RoPE query [Hq, d]
    token: int  # the step's greedy output: the request's second token
    keys: torch.Tensor  # [L, H, d]: the K of the token the step ran on (the first), every layer, as the pool keeps it
    values: torch.Tensor  # [L, H, d]: its V


class _PrefillHandler:
    needs_mask = True  # a one-token run after a cached prefix still needs its (sliding-window) mask

    def __init__(
        self,
        selector: Selector | None,
        kinds: LayerKinds,
        on_layer: LayerSink,
        capture: HiddenCapture | None,
        last_query_scores: bool = False,
    ) -> None:
        self.last_query_scores = last_query_scores
        self.selector = selector
        self.kinds = kinds
        self.on_layer = on_layer
        self.capture = capture
        self.metadata: dict[int, dict[str, torch.Tensor]] = {}

    def attend(self, module, query, key, value, attention_mask, **kwargs: Any):
        out = dense_attention(module, query, key, value, attention_mask, **kwargs)
        layer = module.layer_idx
        metadata: dict[str, torch.Tensor] = {}
        if self.selector is not None and layer >= DENSE_LAYERS and self.kinds.is_full(layer):
            hidden = self.capture.get(layer) if self.capture is not None else None
            metadata = self.selector.build_metadata(
                PrefillLayer(layer, query[0].detach(), key[0].detach(), None if hidden is None else hidden[0].detach())
            )
        self.metadata[layer] = metadata
        # [1, H, n, d] -> [n, H, d]: the token-major layout of the engine's stores
        k, v = key[0].transpose(0, 1).contiguous(), value[0].transpose(0, 1).contiguous()
        if self.last_query_scores and layer >= DENSE_LAYERS:
            scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
            self.on_layer(layer, k, v, metadata, last_query_attention(query[0, :, -1], key[0], scaling))
        else:
            self.on_layer(layer, k, v, metadata)
        return out


class PrefillRunner:
    """Runs prefill one request at a time (batch 1, no padding) on the prefill node."""

    def __init__(
        self,
        model: PreTrainedModel,
        selector: Selector | None,
        sampler: Sampler | None = None,
    ) -> None:
        check_runnable(model)
        self.model = model
        self.selector = selector
        self.sampler = sampler or Sampler()
        # benchmarks: the decode node's emulated compute per layer (`serve --emulate-layer-ms`, or its floor), slept
        # in every decode step this node runs (the forecast, a head start): they stand for the same device's steps
        self.emulation = Emulation()
        self.kinds = layer_kinds(model.config)
        needs_hidden = selector is not None and getattr(selector, "needs_prefill_hidden", False)
        self.capture = HiddenCapture(model) if needs_hidden else None
        # metadata built from every prompt token's query or hidden state cannot start after a cached prefix
        self.selector_reads_queries = needs_hidden or bool(selector is not None and selector.reads_prefill_queries)

    def run(
        self,
        input_ids: torch.Tensor | list[int],
        on_layer: LayerSink | None = None,
        *,
        last_query_scores: bool = False,
        prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
        keep_cache: bool = False,
    ) -> PrefillOutput:
        """Prefills one prompt; `on_layer` gets each layer's K/V as soon as it exists.

        `last_query_scores`: also hand each layer >= 2 the prompt's last query's attention per token (the
        "query" proactive strategy picks blocks by it; only requests that use it pay for it).
        `prefix`: K and V [L, P, H, d] of the prompt's first P tokens (a prefix cache hit): only the rest is
        computed, and `on_layer` still gets every token's K/V. Selector metadata then sees the queries of
        the computed tokens only (see `Selector.reads_prefill_queries`).
        `keep_cache`: the output keeps HF's cache of the prompt, so `forecast` can run the first decode step.
        """
        ids = torch.as_tensor(input_ids, dtype=torch.int64).view(1, -1).to(self.model.device)
        if ids.shape[1] == 0:
            raise ValueError("the prompt is empty")
        cached = 0 if prefix is None else prefix[0].shape[1]
        if cached >= ids.shape[1]:
            raise ValueError(f"a cached prefix of {cached} tokens leaves nothing of the {ids.shape[1]}-token prompt")
        cache: DynamicCache | None = DynamicCache() if keep_cache else None
        length = ids.shape[1]
        if prefix is not None and cached:
            device = self.model.device
            # [L, P, H, d] -> per layer [1, H, P, d]; a cache built without the config keeps every layer whole,
            # so sliding-window layers still hand the engine all their K/V
            cache = DynamicCache(
                ddp_cache_data=[
                    (k.transpose(0, 1).unsqueeze(0).to(device), v.transpose(0, 1).unsqueeze(0).to(device))
                    for k, v in zip(prefix[0], prefix[1])
                ]
            )
            ids = ids[:, cached:]
        extra: dict[str, Any] = (
            {"use_cache": False} if cache is None else {"use_cache": True, **with_cache(self.model, cache)}
        )
        handler = _PrefillHandler(
            self.selector, self.kinds, on_layer or (lambda *_: None), self.capture, last_query_scores
        )
        if self.capture is not None:
            self.capture.start()
        try:
            with torch.no_grad(), use_handler(handler):
                logits = self.model(input_ids=ids, **extra, logits_to_keep=1).logits[0, -1]
                logits = logits.float()
        finally:
            if self.capture is not None:
                self.capture.stop()
        token = int(self.sampler(logits.unsqueeze(0))[0])
        metadata = [handler.metadata.get(layer, {}) for layer in range(self.model.config.num_hidden_layers)]
        return PrefillOutput(token, logits, metadata, cache if keep_cache else None, length)

    def forecast(self, output: PrefillOutput, *, keep_cache: bool = False) -> Forecasted:
        """The first decode step, run here on the prompt's K/V as the decode node will run it: every layer a decode
        step selects in (full attention, layer >= 2) attends to what this node's selector picks from the prompt's
        metadata, as the decode node's (the same selector and budget) will. Returns each such layer's post-RoPE query
        [Hq, d] (the decode node selects with them to fetch ahead, never to attend), the step's greedy token (the
        request's second) and the first token's K/V in every layer. Dense attention here gave queries that drift
        from the sparse step's layer by layer (76-78% of step one's picks on the 16-layer sample); a selector that
        picks by something other than the query (a look-ahead one) leaves the step dense. `keep_cache`: the output
        keeps the cache, now with the first token, for `forecast_next`."""
        forecasted = self.step_ahead(output, output.first_token)
        if not keep_cache:
            output.cache = None  # the K/V are the engine's to keep; this copy goes now
        return forecasted

    def forecast_next(
        self, output: PrefillOutput, token: int, *, yield_to: Callable[[], bool] | None = None
    ) -> dict[int, torch.Tensor]:
        """The step after `forecast` (its cache kept), on `token`, the second: its query per selecting layer, as
        `forecast` gives them. It is the decode node's first step when the second token came from `forecast`
        (Policy.second_token); the cache goes after it. `yield_to` as for `step_ahead`: True before a layer gives
        the step up (StepYielded)."""
        try:
            return self._forecast_step(output, token, yield_to)[0].queries
        finally:
            output.cache = None

    def step_ahead(
        self, output: PrefillOutput, token: int, *, yield_to: Callable[[], bool] | None = None
    ) -> Forecasted:
        """One more decode step on `token` (the last output token) over the kept cache, which it extends, as
        `forecast` runs one (Policy.head_start): its queries, the next token (greedy), and `token`'s K/V in every
        layer. `yield_to` is asked before each layer: True abandons the step (StepYielded), so a prompt that
        arrives mid-step waits at most a layer, not a step."""
        handler, logits = self._forecast_step(output, token, yield_to)
        layers = range(self.model.config.num_hidden_layers)
        return Forecasted(
            handler.queries,
            int(logits.float().argmax()),
            torch.stack([handler.keys[layer] for layer in layers]),
            torch.stack([handler.values[layer] for layer in layers]),
        )

    def _forecast_step(
        self, output: PrefillOutput, token: int, yield_to: Callable[[], bool] | None = None
    ) -> tuple[_ForecastHandler, torch.Tensor]:
        """One decode step on `token` over the prefill run's cache (which it extends): its handler and logits [V]."""
        if output.cache is None:
            raise ValueError("forecast needs a prefill run with keep_cache=True")
        sparse = (
            self.selector is not None and not self.selector.lookahead and not isinstance(self.selector, DenseSelector)
        )
        handler = _ForecastHandler(
            self.kinds,
            self.selector if sparse else None,
            output.metadata,
            output.length,
            emulation=self.emulation,
            yield_to=yield_to if _truncatable(output.cache) else None,
        )
        position = output.cache.get_seq_length()  # the prompt, and any token a step before this one added
        ids = torch.tensor([[token]], dtype=torch.int64, device=self.model.device)
        positions = torch.tensor([[position]], dtype=torch.int64, device=self.model.device)
        try:
            with torch.no_grad(), use_handler(handler):
                logits = self.model(
                    input_ids=ids,
                    position_ids=positions,
                    **with_cache(self.model, output.cache),
                    use_cache=True,
                    logits_to_keep=1,
                ).logits[0, -1]
        except StepYielded:
            _truncate(output.cache, position)  # the layers it ran have this token's K/V: the next step must not
            raise
        return handler, logits


def _truncatable(cache: DynamicCache) -> bool:
    """Whether `_truncate` can undo a step on this cache: plain per-layer K/V (a sliding-window layer keeps a window
    that a cut cannot restore, so a step over one is never abandoned)."""
    layers = getattr(cache, "layers", None)
    return layers is not None and all(type(layer).__name__ == "DynamicLayer" for layer in layers)


def _truncate(cache: DynamicCache, length: int) -> None:
    """Cuts every layer of `cache` back to its first `length` positions."""
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is not None and values is not None and keys.shape[-2] > length:
            layer.keys, layer.values = keys[..., :length, :], values[..., :length, :]  # type: ignore[union-attr]


class _ForecastHandler:
    """Captures the first decode step's queries and its token's K/V; with a selector, attends as the decode node's
    sparse step does."""

    needs_mask = True

    def __init__(
        self,
        kinds: LayerKinds,
        selector: Selector | None,
        metadata: list[dict[str, torch.Tensor]],
        length: int,
        *,
        emulation: Emulation | None = None,
        yield_to: Callable[[], bool] | None = None,
    ) -> None:
        """`emulation` sleeps in each layer, as the decode node's runner does; `yield_to` is asked before each
        layer, and True gives the step up (StepYielded)."""
        self.kinds = kinds
        self.selector = selector
        self.metadata = metadata
        self.length = length
        self.queries: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}  # per layer the stepped token's K [H, d] (the last entry of `key`)
        self.values: dict[int, torch.Tensor] = {}
        self.emulated = emulation.step() if emulation else None
        self.yield_to = yield_to

    def attend(self, module, query, key, value, attention_mask, scaling=None, softcap=None, **kwargs: Any):
        if self.yield_to is not None and self.yield_to():
            raise StepYielded
        out = self._attend(module, query, key, value, attention_mask, scaling, softcap, **kwargs)
        if self.emulated is not None:
            self.emulated.layer()
        return out

    def _attend(self, module, query, key, value, attention_mask, scaling, softcap, **kwargs: Any):
        layer = module.layer_idx
        self.keys[layer], self.values[layer] = key[0, :, -1].detach().clone(), value[0, :, -1].detach().clone()
        step_query = query[:, :, -1]  # [1, Hq, d]
        selects = layer >= DENSE_LAYERS and self.kinds.is_full(layer)
        if selects:
            self.queries[layer] = step_query[0].detach().contiguous()
        if not selects or self.selector is None:
            return dense_attention(
                module, query, key, value, attention_mask, scaling=scaling, softcap=softcap, **kwargs
            )
        n, current = self.length, key.shape[2] - 1  # the prompt, and the position being decoded
        positions = torch.tensor([current], dtype=torch.int64)
        picked = self.selector.select(StepQuery(layer, step_query, None, positions, [n]), [self.metadata[layer]])
        picked = picked.to(key.device)  # [H, k], -1 = none
        # the decode node's row: the prompt's picks, then every token generated before this one (all attended)
        generated = torch.arange(n, current, device=key.device).expand(picked.shape[0], -1)
        picked = torch.cat([picked, generated], dim=1)
        valid = picked >= 0
        rows = key[0, :, :current]  # [H, current, d]: the K before the token being decoded (the last entry of `key`)
        gather = picked.clamp(min=0)[..., None].expand(-1, -1, rows.shape[-1])
        # valid entries first in each row, as `assemble` lays them out: sparse_decode_attention reads a prefix
        order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
        gather = gather.gather(1, order[..., None].expand_as(gather))
        keys, values = rows.gather(1, gather), value[0, :, :current].gather(1, gather)
        out = sparse_decode_attention(
            step_query,
            keys,
            values,
            valid.sum(dim=1).to(torch.int32),
            scaling,
            extra_key=key[0, :, -1],
            extra_value=value[0, :, -1],
            softcap=softcap,
        )
        return out.unsqueeze(1), None  # [1, 1, Hq, d]


class _CaptureQK:
    def __init__(self) -> None:
        self.queries: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}

    def attend(self, module, query, key, value, attention_mask, **kwargs: Any):
        self.queries[module.layer_idx] = query[0].detach().float()  # [Hq, n, d]
        self.keys[module.layer_idx] = key[0].detach().float()  # [H, n, d]
        return dense_attention(module, query, key, value, attention_mask, **kwargs)


def capture_qk(
    model: PreTrainedModel, input_ids: torch.Tensor | list[int]
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Post-RoPE queries [Hq, n, d] and keys [H, n, d] of every layer for one prompt (offline calibration)."""
    ids = torch.as_tensor(input_ids, dtype=torch.int64).view(1, -1).to(model.device)
    handler = _CaptureQK()
    with torch.no_grad(), use_handler(handler):
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    return handler.queries, handler.keys


def infinigen_skewing(model: PreTrainedModel, input_ids: torch.Tensor | list[int]) -> dict[int, torch.Tensor]:
    """InfiniGen's offline skewing matrices from one warm-up prompt, for every sparse full-attention layer."""
    from smartgen.runtime.models import model_info
    from smartgen.selectors.infinigen import compute_skewing

    queries, keys = capture_qk(model, input_ids)
    kinds = layer_kinds(model.config)
    sparse = [layer for layer in queries if layer >= DENSE_LAYERS and kinds.is_full(layer)]
    return compute_skewing(model_info(model), {i: queries[i] for i in sparse}, {i: keys[i] for i in sparse})


def last_query_attention(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """Per token, the most any query head of the prompt's last position attends to it: [n] float32.

    query [Hq, d] (the last position), key [H, n, d] post-RoPE; GQA: each KV head serves Hq / H query
    heads. A push sends every head of a token, so a token counts as much as its best head.
    """
    heads = query.shape[0]
    keys = key.float().repeat_interleave(heads // key.shape[0], dim=0)  # [Hq, n, d]
    logits = torch.einsum("hd,hnd->hn", query.float(), keys) * scaling
    return torch.softmax(logits, dim=-1).amax(dim=0)
