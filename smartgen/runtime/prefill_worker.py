"""The prefill side's one worker: the prefill node and the in-process pipeline prefill requests through it.

For each request the engine has opened:
1. the model runs over the prompt (only past its cached prefix, when the engine's prefix cache
   holds one); each layer's K/V go to the engine as soon as the layer is done (pushed per the
   request's plan), its selector metadata to the decode side;
2. FIRST_TOKEN leaves (after the proactive set has landed, for drop-remote policies), then, for a
   policy that forecasts, the first decode step runs here as the decode node will run it and its queries leave
   (FORECAST): the decode node fetches what that step will pick before the step; with them, under a policy
   that asks, that step's token (the request's second) and the first token's K/V, so the decode node goes on
   from the third token, and then the queries of the step after (a second FORECAST: the decode node's own first
   step, whose picks a joining request fetches before it joins);
3. a request released or aborted meanwhile is dropped quietly; one that fails is failed on the
   decode side at once (ERROR, with the reason), and the worker goes on with the next.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

import torch

from smartgen.engine import messages as msg
from smartgen.engine.policy import Strategy
from smartgen.engine.prefill import OpenedRequest, PrefillEngine, RequestGone
from smartgen.runtime.prefill import PrefillOutput, PrefillRunner, StepYielded

__all__ = ["PrefillWorker", "KVTransform"]

log = logging.getLogger(__name__)

# kv_transform(layer, k [n, H, d], v [n, H, d]) -> (k, v): applied at the hand-off (the quantized-KV scheme)
KVTransform = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class PrefillWorker:
    """Prefills the requests a PrefillEngine opens, one at a time, with a PrefillRunner."""

    def __init__(
        self,
        engine: PrefillEngine,
        runner: PrefillRunner,
        *,
        kv_transform: KVTransform | None = None,
        on_prefilled: Callable[[int, float], None] | None = None,
        on_metadata: Callable[[int, int], None] | None = None,
        log_failures: bool = True,
    ) -> None:
        """`on_prefilled(length, seconds)` hears each prefill's duration (a planner learning T_p);
        `on_metadata(length, bytes)` each request's selector metadata bytes (a planner leaving their link time
        out of K_r);
        `log_failures=False` when the caller re-raises `errors` itself (no second report on stderr)."""
        self.engine = engine
        self.runner = runner
        self.kv_transform = kv_transform
        self.on_prefilled = on_prefilled
        self.on_metadata = on_metadata
        self._metadata_bytes = 0  # this request's selector metadata sent so far
        self.log_failures = log_failures
        self.num_prefilled = 0
        self.computed_tokens = 0  # prompt tokens really run through the model (a cached prefix is not)
        self._raw: list[tuple[torch.Tensor, torch.Tensor]] = []  # this request's K/V before kv_transform
        self.errors: list[BaseException] = []  # what failed requests raised, for callers that re-raise
        self.head_tokens = 0  # tokens decoded by head starts (Policy.head_start)
        # this node's own decode steps beyond the second token's (head-start steps, forecasts of the decode node's
        # first step) given up for a prompt waiting for prefill
        self.steps_yielded = 0

    def run(self, stop: threading.Event, poll: float = 0.05) -> None:
        """Serves requests until `stop` is set."""
        while not stop.is_set():
            request = self.engine.next_request(timeout=poll)
            if request is not None:
                self.prefill(request)

    def prefill(self, request: OpenedRequest) -> bool:
        """Prefills one request; False when it was dropped or failed (the decode side has been told)."""
        rid = request.request_id
        if request.prompt is None:
            self.engine.fail(rid, "OPEN carried no prompt ids")
            return False
        started = time.monotonic()
        self._raw = []
        self._metadata_bytes = 0
        try:
            # a selector that reads every prompt query would see only the computed ones: no cached prefix for it
            prefix = None if self.runner.selector_reads_queries else self.engine.lookup_prefix(request)
            computed = request.length - (0 if prefix is None else prefix[0].shape[1])
            forecast = self._forecasts(request)
            # decoded here from its second token on unless a prompt arrives meanwhile (`_head_start`)
            head_start = forecast and request.policy.head_start and request.head_tokens > 0
            self.engine.begin_prefill(request, computed, head_start=head_start and not self._prompt_waiting())
            output = self.runner.run(
                request.prompt,
                on_layer=functools.partial(self._hand_off, rid),
                last_query_scores=request.policy.strategy == Strategy.QUERY,
                prefix=prefix,
                **({"keep_cache": True} if forecast else {}),
            )
            self.computed_tokens += computed
            if self.on_prefilled is not None:
                self.on_prefilled(computed, time.monotonic() - started)
            if self.on_metadata is not None and not request.resumed:
                self.on_metadata(request.length, self._metadata_bytes)
            self.engine.finish_prefill(rid, output.first_token, forecast=forecast)
            if forecast:
                self._forecast(request, output)
        except RequestGone:
            return False  # released or aborted while prefilling (the decode node gave up on it)
        except Exception as exc:  # a failed prefill fails its request, not the worker
            if self.log_failures:
                log.warning("prefill of %s failed: %s", rid, exc, exc_info=not isinstance(exc, ValueError))
            self.errors.append(exc)
            self.engine.fail(rid, f"prefill failed: {exc}")
            return False
        finally:  # after FIRST_TOKEN left: caching the prompt's blocks costs the request nothing
            raw = None
            if self._raw and len(self._raw) == self.engine.layout.num_layers:
                raw = torch.stack([k for k, _ in self._raw]), torch.stack([v for _, v in self._raw])
            self._raw = []
            self.engine.cache_prefix(request, raw)
        self.num_prefilled += 1
        return True

    def _forecasts(self, request: OpenedRequest) -> bool:
        """Whether this request gets a FORECAST of its first decode step: its policy asks, the runner can run one
        (a model, not a synthetic stand-in) and its selector picks a share (a dense one picks everything)."""
        selector = getattr(self.runner, "selector", None)
        return (
            request.policy.forecast
            and not request.resumed
            and hasattr(self.runner, "forecast")
            and selector is not None
            and selector.sparse
            and not selector.lookahead
        )

    def _forecast(self, request: OpenedRequest, output: PrefillOutput) -> None:
        """The first decode step's queries to the decode node; under a policy that asks (`second_token`) the step's
        token with the first token's K/V too, then the queries of the step after it (the decode node's own first
        step). FIRST_TOKEN promised a FORECAST, and one with a second token promises the next: a failure here still
        sends each promised one (empty), and the decode node then decodes without it."""
        queries: dict[int, torch.Tensor] = {}
        second = None
        try:
            forecasted = self.runner.forecast(output, keep_cache=request.policy.second_token)
            queries = forecasted.queries
            if request.policy.second_token:
                second = msg.SecondToken(forecasted.token, forecasted.keys, forecasted.values)
        except Exception:
            log.warning("forecast of %s failed; its decode node goes on without", request.request_id, exc_info=True)
        if not self.engine.send_forecast(request.request_id, queries, second) or second is None:
            output.cache = None
            return
        queries = {}
        try:
            if not self._head_start(request, output, second.token):
                # given up at once for a prompt already waiting (one that cut a head start short too), or at the
                # next layer for one arriving: it helps the decode node's first step, while a burst's later prompts
                # would each wait a step more for every request ahead of them
                queries = self.runner.forecast_next(output, second.token, yield_to=self._prompt_waiting)
        except StepYielded:
            self.steps_yielded += 1
        except Exception:
            log.warning("forecast of %s's next step failed", request.request_id, exc_info=True)
        finally:
            output.cache = None
        # after a head start, this empty FORECAST ends its tokens: the decode node takes over from the last one
        self.engine.send_forecast(request.request_id, queries, step=2)

    def _head_start(self, request: OpenedRequest, output: PrefillOutput, token: int) -> int:
        """Policy.head_start: decodes the request on from its second token (`token`) while `head_start_wanted` says
        so, each token sent at once with the K/V of the one its step ran on (FORECAST step 3). An end of sequence
        does not stop it: the decode node knows whether the request ignores it, and ends the request (RELEASE) when
        it does not. A prompt arriving mid-step abandons the step at the next layer: a head start only uses idle
        time, so it must not hold up a prefill by a whole step. Returns the tokens sent."""
        rid, sent = request.request_id, 0
        while self.engine.head_start_wanted(rid, sent):
            self.engine.note_head_step(rid)  # its KV goes on crossing meanwhile
            try:
                step = self.runner.step_ahead(output, token, yield_to=self._prompt_waiting)
            except StepYielded:
                self.steps_yielded += 1
                break
            if not self.engine.send_forecast(rid, {}, msg.SecondToken(step.token, step.keys, step.values), step=3):
                break
            token, sent = step.token, sent + 1
            self.head_tokens += 1
        return sent

    def _prompt_waiting(self) -> bool:
        return self.engine.num_queued > 0

    def _hand_off(
        self,
        request_id: str,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: dict,
        token_scores: torch.Tensor | None = None,
    ) -> None:
        """One prefilled layer: its K/V to the engine (pushed per plan), its selector metadata to the decode side."""
        if self.kv_transform is not None:
            if self.engine.prefix_cache.enabled:  # the cache keeps K/V as computed, for later prefills to build on
                self._raw.append((k, v))
            k, v = self.kv_transform(layer, k, v)
        self.engine.prefill_layer(request_id, layer, k, v, token_scores)
        self._metadata_bytes += self.engine.send_metadata(request_id, layer, metadata)
