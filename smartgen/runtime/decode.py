"""Decode runner: generates tokens on the decode node through transformers' extension points.

Per step, for every attention layer l of the batch:
1. the idle notice goes out (speculative policies push their next slice);
2. the index is made: layers 0-1 (and a dense selector) take every prompt token, sliding-window
   layers their window, other layers the selector's pick; every row also gets the tokens
   generated so far (local, always attended);
3. the engine splits it by the mask and gathers local entries while remote ones are fetched;
4. attention runs over the gathered rows plus the token being decoded (whose K/V the
   `EngineCache.update` call has just appended to the pool).
With a lookahead selector (InfiniGen) steps 2-3 for layer l+1 start in a background worker
as soon as layer l's attention is done, so the fetch overlaps layer l's FFN (on CUDA the
worker runs on its own stream).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from smartgen.engine.attention import merge_partials, span_decode_attention, sparse_decode_attention
from smartgen.engine.decode import Assembled, DecodeEngine
from smartgen.engine.decode.request import AttendAsk
from smartgen.engine.layout import DENSE_LAYERS
from smartgen.lanes.thread_priority import batch_this_thread, preemptions
from smartgen.runtime.cache_kwarg import with_cache
from smartgen.runtime.capture import HiddenCapture
from smartgen.runtime.emulation import Emulation
from smartgen.runtime.hooks import use_handler
from smartgen.runtime.models import check_runnable, layer_kinds, model_info
from smartgen.runtime.sampling import Sampler
from smartgen.selectors.base import Selector, StepQuery, pad_rows
from smartgen.selectors.dense import DenseSelector
from smartgen.selectors.infinigen import QuerySpeculator

__all__ = ["DecodeBatch", "EngineCache", "DecodeRunner"]


@dataclass(slots=True, init=False)  # the __init__ below: `positions` is optional there, never None after it
class DecodeBatch:
    """Requests decoding together; each has its prompt length, metadata and current position."""

    request_ids: list[str]
    prompt_lengths: list[int]
    metadata: list[list[dict[str, torch.Tensor]]]  # [request][layer]
    last_tokens: torch.Tensor  # [B] the token to feed next
    positions: torch.Tensor  # [B] its position; defaults to the prompt length

    def __init__(
        self,
        request_ids: list[str],
        prompt_lengths: list[int],
        metadata: list[list[dict[str, torch.Tensor]]],
        last_tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> None:
        self.request_ids = request_ids
        self.prompt_lengths = prompt_lengths
        self.metadata = metadata
        self.last_tokens = last_tokens
        self.positions = torch.tensor(prompt_lengths, dtype=torch.int64) if positions is None else positions
        if not (len(self.request_ids) == len(self.prompt_lengths) == len(self.metadata) == len(self.last_tokens)):
            raise ValueError("a decode batch needs one id, length, metadata list and last token per request")

    def advance(self, tokens: torch.Tensor, rows: list[int] | None = None) -> None:
        """The requests at `rows` (default: all) decoded `tokens`; the others (held back) feed theirs again."""
        if rows is None:
            self.last_tokens = tokens
            self.positions = self.positions + 1
            return
        self.last_tokens = self.last_tokens.clone()
        self.last_tokens[rows] = tokens
        self.positions = self.positions.clone()
        self.positions[rows] += 1

    def subset(self, rows: list[int]) -> DecodeBatch:
        """The requests at `rows` as a batch of their own (this one unchanged)."""
        return DecodeBatch(
            [self.request_ids[i] for i in rows],
            [self.prompt_lengths[i] for i in rows],
            [self.metadata[i] for i in rows],
            self.last_tokens[rows],
            self.positions[rows],
        )

    def drop(self, keep: list[int]) -> None:
        """Keeps only the requests at `keep` (finished ones leave the batch)."""
        self.request_ids = [self.request_ids[i] for i in keep]
        self.prompt_lengths = [self.prompt_lengths[i] for i in keep]
        self.metadata = [self.metadata[i] for i in keep]
        self.last_tokens = self.last_tokens[keep]
        self.positions = self.positions[keep]


class EngineCache(Cache):
    """The decode engine's pool as a transformers Cache: `update` appends the new token's K/V ([B, H, 1, d])."""

    def __init__(self, engine: DecodeEngine, request_ids: list[str]) -> None:
        super().__init__(layers=[])
        self.engine = engine
        self.request_ids = request_ids

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        self.engine.append_batch(layer_idx, self.request_ids, key_states[:, :, -1], value_states[:, :, -1])
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:  # positions are passed explicitly
        return 0


class _DecodeHandler:
    def __init__(self, runner: DecodeRunner, batch: DecodeBatch) -> None:
        self.runner = runner
        self.batch = batch
        self.pending: dict[int, Future] = {}
        self.prefetching: dict[int, Future] = {}  # layer -> its prefetch being sent (wait before assembling it)
        self.emulated = runner.emulation.step() if runner.emulation else None

    def attend(self, module, query, key, value, attention_mask, scaling=None, softcap=None, **kwargs: Any):
        runner, batch = self.runner, self.batch
        layer = module.layer_idx
        runner.engine.begin_layer(layer, batch.request_ids)
        prefetch = self.prefetching.pop(layer, None)
        if prefetch is not None:  # its fetches must be on their way before this layer asks for the rest
            prefetch.result()
        future = self.pending.pop(layer, None)
        spans = runner.spans(layer, batch) if future is None else None
        if spans is not None:
            # EngineCache.update has already appended this token, so the span ends with it
            out = span_decode_attention(query[:, :, -1], spans, scaling, softcap)
            self._look_ahead(layer)
            if self.emulated is not None:
                self.emulated.layer()
            return out.unsqueeze(1), None
        if future is not None:
            assembled = future.result()
            if runner.side_stream is not None:
                torch.cuda.current_stream().wait_stream(runner.side_stream)
        else:
            scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
            ask = AttendAsk(query[:, :, -1], scale, None if softcap is None else float(softcap))
            assembled = runner.assemble(layer, batch, query[:, :, -1], None, attend=ask)
        batch_size, num_kv_heads, _, head_dim = key.shape
        out = sparse_decode_attention(
            query[:, :, -1],
            assembled.k.to(query.device),
            assembled.v.to(query.device),
            assembled.num_valid.to(query.device),
            scaling,
            extra_key=key[:, :, -1].reshape(batch_size * num_kv_heads, head_dim),
            extra_value=value[:, :, -1].reshape(batch_size * num_kv_heads, head_dim),
            softcap=softcap,
            with_stats=bool(assembled.attended),
        )
        if assembled.attended:  # the local part, kept in fp32 with its max and sum, then each remote part merged in
            out, stats = out
            for b, part, part_stats in runner.engine.land_attended(layer, batch.request_ids, assembled.attended):
                out[b] = merge_partials([(out[b], stats[b]), (part.to(out.device), part_stats.to(out.device))])
            out = out.to(query.dtype)
        self._look_ahead(layer)
        if self.emulated is not None:  # benchmarks: a slower decode device's compute, overlapping the look-ahead fetch
            self.emulated.layer()
        return out.unsqueeze(1), None  # [B, 1, Hq, d]

    def _look_ahead(self, layer: int) -> None:
        """With a lookahead selector, start layer l+1's selection and fetch now, under layer l's FFN; with a policy
        that prefetches, start fetching what a speculated selection of layer l+1 lacks."""
        runner = self.runner
        next_layer = layer + 1
        if next_layer >= runner.num_layers or runner.ranges(next_layer, self.batch) is not None:
            return
        lookahead = runner.selector.lookahead
        rows = None if lookahead else runner.engine.prefetchers(self.batch.request_ids, next_layer)
        if rows == []:
            return
        capture = runner.capture
        assert capture is not None  # DecodeRunner makes one for every sparse selector
        captured = capture.get(layer)
        assert captured is not None  # step() started the capture and this layer's pre-hook has just run
        hidden = captured[:, -1]  # [B, D] this layer's attention input
        if lookahead:
            self.pending[next_layer] = runner.worker.submit(runner.assemble_ahead, next_layer, self.batch, hidden)
        else:
            assert rows is not None
            batch = self.batch
            if len(rows) < len(batch.request_ids):  # the speculated selection only for the requests that prefetch
                batch, hidden = batch.subset(rows), hidden[rows]
            self.prefetching[next_layer] = runner.worker.submit(runner.prefetch, next_layer, batch, hidden)


class DecodeRunner:
    """Runs decode steps of a batch over a DecodeEngine's pool."""

    def __init__(
        self,
        model: PreTrainedModel,
        selector: Selector,
        engine: DecodeEngine,
        sampler: Sampler | None = None,
        *,
        emulation: Emulation | None = None,
    ) -> None:
        """`emulation` sleeps in every layer of every step: a benchmark's stand-in for a slower decode device, so
        one step's link budget matches a real deployment's (see `smartgen bench` and runtime/emulation.py)."""
        check_runnable(model)
        self.emulation = emulation or Emulation()
        self.model = model
        self.selector = selector
        self.engine = engine
        self.sampler = sampler or Sampler()
        self.kinds = layer_kinds(model.config)
        self.num_layers = model.config.num_hidden_layers
        self.num_kv_heads = model.config.num_key_value_heads
        # every sparse selector: a policy that prefetches speculates layer l+1's query from layer l's input
        self.capture = HiddenCapture(model) if not isinstance(selector, DenseSelector) else None
        self._speculator: QuerySpeculator | None = None
        # started by the step thread, yet never to cut into its step as it wakes (thread_priority)
        self.worker = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="smartgen-fetch", initializer=batch_this_thread
        )
        self.side_stream = torch.cuda.Stream() if model.device.type == "cuda" else None
        self._widened: dict[float, Selector | None] = {}  # the selector at (1 + hints) x its budget

    def close(self) -> None:
        self.worker.shutdown(wait=True)
        if self.capture is not None:
            self.capture.remove()

    def index(
        self, layer: int, batch: DecodeBatch, query: torch.Tensor | None, hidden: torch.Tensor | None
    ) -> torch.Tensor:
        """The KV index [B·H, k] of one layer: prompt selection plus every earlier generated token."""
        return self._index(layer, batch, query, hidden, None)[0]

    def _index(
        self,
        layer: int,
        batch: DecodeBatch,
        query: torch.Tensor | None,
        hidden: torch.Tensor | None,
        wide: Selector | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`index`, and with `wide` (the selector at a wider budget) also what it picks past the layer's own pick
        [B·H, k'], likeliest first where the selector ranks in one pass (`Selector.select_with_next`); None for a
        layer that selects nothing."""
        heads = self.num_kv_heads
        window = self.kinds.windows[layer]
        positions = batch.positions.tolist()
        rows: list[torch.Tensor] = []
        if window is not None:
            for p in positions:  # the window holds the current token too, which attends from its own K/V
                rows.append(torch.arange(max(0, p - window + 1), p).expand(heads, -1))
            return pad_rows(rows), None
        dense = layer < DENSE_LAYERS or isinstance(self.selector, DenseSelector)
        following = None
        if dense:
            prompt = [torch.arange(n).expand(heads, n) for n in batch.prompt_lengths]
        else:
            step = StepQuery(layer, query, hidden, batch.positions, batch.prompt_lengths)
            metadata = [meta[layer] for meta in batch.metadata]
            if wide is None:
                picked = self.selector.select(step, metadata).cpu()
            else:
                picked, following = self.selector.select_with_next(step, metadata, wide)
                picked = picked.cpu()
            prompt = [picked[b * heads : (b + 1) * heads] for b in range(len(batch.request_ids))]
        for b, (n, p) in enumerate(zip(batch.prompt_lengths, positions)):
            generated = torch.arange(n, p).expand(heads, -1)
            rows.append(torch.cat([prompt[b], generated], dim=1))
        return pad_rows(rows), following

    def fetch_forecast(
        self, request_id: str, queries: dict[int, torch.Tensor], metadata: list[dict[str, torch.Tensor]], length: int
    ) -> int:
        """Selects with a FORECAST's queries (the first step's, from the prefill node) and has the engine fetch the
        remote entries of each layer's pick at low priority; returns the entries asked for. A selector that picks by
        something other than the query (a look-ahead one) or picks everything gets none."""
        if isinstance(self.selector, DenseSelector) or self.selector.lookahead:
            return 0
        config = self.model.config
        shape = (
            config.num_attention_heads,
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        )
        batch = DecodeBatch([request_id], [length], [metadata], torch.zeros(1, dtype=torch.int64))
        asked = 0
        for layer, query in sorted(queries.items()):
            if not (DENSE_LAYERS <= layer < self.num_layers and self.kinds.is_full(layer)) or query.shape != shape:
                continue  # a layer no step selects in, or a query of another model: nothing to forecast there
            step_query = query.to(device=self.model.device, dtype=self.model.dtype)[None]  # [1, Hq, d]
            index = self.index(layer, batch, step_query, None)
            asked += self.engine.fetch_forecast(layer, request_id, index.to(self.engine.pool.k.device))
        return asked

    def ranges(self, layer: int, batch: DecodeBatch) -> tuple[list[int], list[int]] | None:
        """Token ranges [start, stop) per request when the layer reads a contiguous span (dense or window)."""
        positions = batch.positions.tolist()
        window = self.kinds.windows[layer]
        if window is not None:
            return [max(0, p - window + 1) for p in positions], positions
        if layer < DENSE_LAYERS or isinstance(self.selector, DenseSelector):
            return [0] * len(positions), positions
        return None

    def spans(self, layer: int, batch: DecodeBatch) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Pool views for a dense or window layer whose tokens (the current one included) are all local."""
        ranges = self.ranges(layer, batch)
        if ranges is None:
            return None
        starts, stops = ranges
        return self.engine.local_spans(layer, batch.request_ids, starts, [stop + 1 for stop in stops])

    def assemble(
        self,
        layer: int,
        batch: DecodeBatch,
        query: torch.Tensor | None,
        hidden: torch.Tensor | None,
        attend: AttendAsk | None = None,
    ) -> Assembled:
        """The layer's selection (from `query`, or speculated from `hidden`) gathered by the engine; with `attend`,
        the requests that attend to remote entries in place send them with the query instead (`Assembled.attended`)."""
        index, following = self._index(layer, batch, query, hidden, self._hint_selector(layer, batch))
        assembled = self.engine.assemble(layer, batch.request_ids, index.to(self.engine.pool.k.device), attend=attend)
        if following is not None:  # after the layer's own entries are in: noting hints never delays them
            self.engine.hint(layer, batch.request_ids, following.cpu().to(self.engine.pool.k.device))
        return assembled

    def _hint_selector(self, layer: int, batch: DecodeBatch) -> Selector | None:
        """For policies with hints, on a sparse full-attention layer: the selector at (1 + hints) x its budget,
        whose extra picks (what the selector is likely to pick next) the engine has pushed ahead; else None."""
        factor = self.engine.hint_factor(batch.request_ids, layer)
        if factor <= 0 or self.ranges(layer, batch) is not None:
            return None
        if factor not in self._widened:
            self._widened[factor] = self.selector.widened(factor)
        return self._widened[factor]

    def prefetch(self, layer: int, batch: DecodeBatch, hidden: torch.Tensor) -> None:
        """Speculates layer `layer`'s query from the previous layer's attention input and has the engine fetch the
        remote entries of the selection it gives (policies that prefetch)."""
        if self._speculator is None:
            self._speculator = QuerySpeculator(model_info(self.model))
        query = self._speculator.query(layer, hidden, batch.positions.to(hidden.device))
        index = self.index(layer, batch, query, None)
        self.engine.prefetch(layer, batch.request_ids, index.to(self.engine.pool.k.device))

    def assemble_ahead(self, layer: int, batch: DecodeBatch, hidden: torch.Tensor) -> Assembled:
        if self.side_stream is not None:
            with torch.cuda.stream(self.side_stream):
                return self.assemble(layer, batch, None, hidden)
        return self.assemble(layer, batch, None, hidden)

    def step(self, batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Feeds each request's last token; returns (next tokens [B], logits [B, V] float32). Counts the step's wall
        time, its thread's CPU, the emulated compute, the link waits and the times another thread preempted it, by
        batch size (`PathCounters.add_step`)."""
        emulation = self.emulation
        started, cpu, emulated, waited, preempted = (
            time.monotonic(),
            time.thread_time(),
            emulation.slept_s,
            self.engine.link_wait_s,
            preemptions(),
        )
        tokens, logits = self._step(batch)
        wall, link_wait = time.monotonic() - started, self.engine.link_wait_s - waited
        self.engine.counters.add_step(
            len(batch.request_ids),
            wall,
            time.thread_time() - cpu,
            emulation.slept_s - emulated,
            link_wait,
            preemptions() - preempted,
        )
        self.engine.note_step(wall - link_wait)  # each member's share of the next step is a part of this
        return tokens, logits

    def _step(self, batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
        handler = _DecodeHandler(self, batch)
        cache = EngineCache(self.engine, batch.request_ids)
        device = self.model.device
        if self.capture is not None:
            self.capture.start()
        try:
            with torch.no_grad(), use_handler(handler):
                logits = (
                    self.model(
                        input_ids=batch.last_tokens.view(-1, 1).to(device),
                        position_ids=batch.positions.view(-1, 1).to(device),
                        **with_cache(self.model, cache),
                        use_cache=True,
                        logits_to_keep=1,
                    )
                    .logits[:, -1]
                    .float()
                )
        finally:
            for future in handler.pending.values():
                future.cancel()
            for future in handler.prefetching.values():  # a step cut short: its prefetches need not go out
                future.cancel()
            if self.capture is not None:
                self.capture.stop()
        return self.sampler(logits), logits
