"""The decode side's one request driver: serving, the in-process pipeline, profiling and evaluation all move
requests through it, one `step()` at a time, so every entry point runs the same lifecycle.

A request's life in the driver:
1. `add()`: the engine opens it (pool slot, masks remote, OPEN to a prefill node): prefilling.
2. `step()` collects FIRST_TOKEN: the first token is emitted (TTFT). Under a wait-for-all
   policy (full transfer) it waits until every block is local, and while other requests are
   running any other policy waits until its layers 0-1 are (its first step would wait for them,
   and the whole batch with it); a request whose FIRST_TOKEN promised a forecast waits, while others run, for
   it, fetches the picks its queries give and joins only once they are local; then it joins the running
   batch at the step boundary. A greedy request under a policy whose forecast brings the second token
   (Policy.second_token) waits for the forecast alone too: that token is emitted as it comes (TTST) and the
   request's first step decodes the third; joining others, it fetches the picks of the next step's forecast (its
   own first step's) instead.
3. `step()` runs one decode step over the running batch: one token per request (the first of
   them is TTST, unless the forecast brought it). Every policy decision inside the step is the request's own (DecodeEngine).
   A request whose fetch stalled parks outside the batch until it lands; one whose fetches held the batch past its
   share of the step is held back: no token this step, and it redoes the step in the next, in the batch.
4. It ends when `stop(token)` says so, at `max_tokens`, on `cancel()`, or when it fails (its
   prefill node lost; before it joins the batch, nothing arriving for it for `prefill_timeout`): the engine
   finishes or aborts it (RELEASE or ABORT, slot freed) and a `Finished` event carries its metrics and why it
   failed ("unavailable": its prefill node was lost or none was live; "overloaded": it had no room; "timeout": it
   stalled; else "error").

The bound before a request joins judges progress, not patience: a request whose KV keeps arriving, however slowly,
or that waits behind requests dispatched before it on its link whose KV keeps arriving (a link moves transfers in
turn), is never failed for taking long; one for which nothing arrived for `prefill_timeout` seconds is
(`DecodeEngine.stall`, whose reason says how much had arrived and since when nothing came).

Timings have one clock and one definition: the engine's `RequestMetrics`, counted from the
request's arrival (`DriverRequest.arrival`), are what `usage`, `/status` and the benchmarks read.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from smartgen.engine.decode import DecodeEngine, LinkLost, RequestFailed
from smartgen.engine.metrics import RequestMetrics
from smartgen.engine.policy import Policy
from smartgen.engine.pool import PoolFull
from smartgen.runtime.decode import DecodeBatch, DecodeRunner
from smartgen.runtime.sampling import Sampler

__all__ = ["DriverRequest", "Token", "Finished", "DecodeDriver"]


@dataclass(slots=True)
class DriverRequest:
    """What the driver needs to run one request."""

    request_id: str
    prompt_ids: torch.Tensor  # [n] int64
    policy: Policy
    max_tokens: int
    sampler: Sampler = field(default_factory=Sampler)
    stop: Callable[[int], bool] = lambda token: False  # end of sequence, stop tokens
    arrival: float = field(default_factory=time.monotonic)  # TTFT and TTST count from here
    keep_logits: bool = False
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # [V] per decoded token, when kept
    oracle_counts: torch.Tensor | None = None  # [L, n]: a recorded run's selection counts (the "optimal" set)


@dataclass(frozen=True, slots=True)
class Token:
    """A token of a request: `index` 0 is the first (from prefill)."""

    request_id: str
    token: int
    index: int
    time: float


@dataclass(frozen=True, slots=True)
class Finished:
    """A request left the driver: reason "stop", "length", "aborted", "error", "overloaded" (a prefill node had no
    room for it), "unavailable" (its prefill node was lost, or none was live, or the decode node is stopping) or
    "timeout" (nothing of its KV arrived for the bound from a prefill node still alive); the last three are worth a
    retry later. `error` says why."""

    request_id: str
    reason: str
    error: str | None
    metrics: RequestMetrics
    tokens: list[int]
    logits: list[torch.Tensor]

    @property
    def failed(self) -> bool:
        """It ended short of its tokens by no one's choice (not finished, not cancelled)."""
        return self.reason in ("error", "overloaded", "unavailable", "timeout")


Event = Token | Finished


class DecodeDriver:
    """Runs requests on a DecodeEngine and a DecodeRunner; not thread-safe (one caller drives it)."""

    def __init__(self, runner: DecodeRunner, *, prefill_timeout: float = 120.0) -> None:
        """`prefill_timeout`: a request waiting for its first token, or for its KV before it joins the batch, fails
        once nothing has arrived for it (nor for the requests ahead of it on its link) for this many seconds."""
        self.runner = runner
        self.engine: DecodeEngine = runner.engine
        self.prefill_timeout = prefill_timeout
        self.prefilling: list[DriverRequest] = []
        self.running: list[DriverRequest] = []
        self.parked: list[DriverRequest] = []  # out of the batch until a fetch it waits for lands (stall_timeout)
        self._batch: DecodeBatch | None = None

    # -- the lifecycle ---------------------------------------------------------------------
    def add(self, request: DriverRequest) -> list[Event]:
        """Opens the request on the engine; a request that cannot be opened finishes at once (the events say so)."""
        try:
            self.engine.open(
                request.prompt_ids.numel(),
                request.policy,
                max_new_tokens=request.max_tokens,
                request_id=request.request_id,
                prompt_ids=request.prompt_ids,
                arrival=request.arrival,
                oracle_counts=request.oracle_counts,
                # how many tokens past the second its prefill node may decode ahead (greedy only, as the second token)
                head_tokens=max(0, request.max_tokens - 2) if self.takes_second(request) else 0,
            )
        except (PoolFull, RuntimeError) as exc:
            metrics = RequestMetrics(request.request_id, request.prompt_ids.numel(), created=request.arrival)
            metrics.error = str(exc)
            kind = "unavailable" if isinstance(exc, LinkLost) else "error"  # no live prefill node to open it on
            return [Finished(request.request_id, kind, str(exc), metrics, [], [])]
        self.prefilling.append(request)
        return []

    def step(self) -> list[Event]:
        """Collects first tokens, then runs one decode step over the running batch (if any)."""
        events = self.collect_first_tokens() + self._resume_parked()
        if self.running:
            events += self._decode_step()
        return events

    def cancel(self, request_id: str, reason: str, *, aborted: bool = True) -> list[Event]:
        """Ends a request wherever it is (client gone, shutdown); its KV is freed on both nodes."""
        for group in (self.prefilling, self.running, self.parked):
            for index, request in enumerate(group):
                if request.request_id == request_id:
                    if group is self.running:
                        self._leave_batch([index])
                    else:
                        del group[index]
                    return [self._abort(request, reason, "aborted" if aborted else "error")]
        return []

    def cancel_all(self, reason: str, kind: str = "error") -> list[Event]:
        """Ends every request with `reason`; `kind` is their Finished reason ("unavailable": the node is stopping)."""
        events: list[Event] = []
        for request in self.prefilling + self.running + self.parked:
            events.append(self._abort(request, reason, kind))
        self.prefilling, self.running, self.parked, self._batch = [], [], [], None
        return events

    @property
    def batch(self) -> DecodeBatch:
        """The running requests' decode batch."""
        assert self._batch is not None, "no request is running"
        return self._batch

    @property
    def num_active(self) -> int:
        return len(self.prefilling) + len(self.running) + len(self.parked)

    # -- inside a step ---------------------------------------------------------------------
    def collect_first_tokens(self) -> list[Event]:
        """Moves prefilled requests into the running batch (their first token is emitted); no decode step."""
        events: list[Event] = []
        still = []
        for request in self.prefilling:
            rid = request.request_id
            if not self.engine.first_token_ready(rid):
                if stall := self.engine.stall(rid, self.prefill_timeout):
                    reason = f"no first token: {stall.describe(self.prefill_timeout)}"
                    events.append(self._abort(request, reason, "timeout"))
                else:
                    still.append(request)
                continue
            try:
                if not request.tokens:
                    events += self._emit(request, self.engine.wait_first_token(rid, timeout=0))
                    if isinstance(events[-1], Finished):
                        continue
                # the forecast step's token is the second (Policy.second_token): it leaves as soon as the FORECAST
                # is here, whatever the request then waits for, and the request's first step decodes the third
                takes_second = self.takes_second(request)
                if takes_second and len(request.tokens) == 1 and not self.engine.forecast_pending(rid):
                    if (second := self.engine.take_second_token(rid)) is not None:
                        events += self._emit(request, second)
                        if isinstance(events[-1], Finished):
                            continue
                # the prefill node's head start (Policy.head_start): its tokens leave as they come, and the request
                # joins only once they end (its step would decode a token the prefill node is decoding)
                finished = False
                while takes_second and (head := self.engine.take_head_token(rid)) is not None:
                    events += self._emit(request, head)
                    if finished := isinstance(events[-1], Finished):
                        break
                if finished:
                    continue
                if self.engine.head_pending(rid):
                    if stall := self.engine.stall(rid, self.prefill_timeout):
                        reason = f"its head start stalled: {stall.describe(self.prefill_timeout)}"
                        events.append(self._abort(request, reason, "timeout"))
                    else:
                        still.append(request)
                    continue
                headed = len(request.tokens) > 2  # its KV has (nearly) all left: no forecast picks to fetch
                # full transfer: decoding starts when every block is here; any other request joins a running batch
                # once its layers 0-1 are (its first step would wait for them, and every request in the batch with
                # it), both under the same bound as the first token: on progress, not on the transfer's length
                # (a request that attends to misses in place steps at once: the prefill node attends to what is
                # not here yet, layers 0-1 and the forecast's picks included)
                attends = request.policy.attend_remote
                waiting = (request.policy.wait_for_all and not self.engine.is_all_local(rid)) or (
                    bool(self.running) and not attends and not self.engine.dense_layers_local(rid)
                )
                # the first step's forecast, while others run or when it brings the second token: wait for it and
                # fetch its picks (a joiner that took the second token: those of the next step's forecast, its own
                # first step's); while others run, join only once they are local (its step would wait for them,
                # and the batch with it). Alone it then starts at once: its step waits for what is in flight instead
                # of asking layer by layer. Alone and without a second token to take it starts without the forecast.
                if not waiting and not headed and (self.running or takes_second):
                    # a joiner past its second token fetches the picks of the step after it: its own first step
                    after = bool(self.running) and len(request.tokens) == 2
                    if self.engine.forecast_pending(rid, after_second=after):
                        waiting = True
                    else:
                        if (queries := self.engine.take_forecast(rid, after_second=after)) is not None:
                            metadata = self.engine.request_metadata(rid)
                            self.runner.fetch_forecast(rid, queries, metadata, request.prompt_ids.numel())
                        waiting = bool(self.running) and not attends and not self.engine.forecast_landed(rid)
                if waiting:
                    if stall := self.engine.stall(rid, self.prefill_timeout):
                        reason = f"its KV stalled: {stall.describe(self.prefill_timeout)}"
                        events.append(self._abort(request, reason, "timeout"))
                    else:
                        still.append(request)
                    continue
            except (RequestFailed, KeyError) as exc:
                events.append(self._abort(request, str(exc), self._failure(rid)))
                continue
            self._join_batch(request)
        self.prefilling = still
        return events

    def _resume_parked(self) -> list[Event]:
        """Parked requests whose late fetches have landed join the batch again; failed ones end."""
        events: list[Event] = []
        still = []
        for request in self.parked:
            rid = request.request_id
            if not self.engine.ready_to_resume(rid):
                still.append(request)
            elif error := self.engine.metrics(rid).error:
                events.append(self._abort(request, error, self._failure(rid)))
            else:
                self._join_batch(request)
        self.parked = still
        return events

    def _join_batch(self, request: DriverRequest) -> None:
        rid, length = request.request_id, request.prompt_ids.numel()
        metadata = self.engine.request_metadata(rid)
        # the token to feed is the last one emitted; a request back from parking is past its first
        position = torch.tensor([length + len(request.tokens) - 1], dtype=torch.int64)
        last = torch.tensor([request.tokens[-1]], dtype=torch.int64)
        if self._batch is None or not self._batch.request_ids:
            self._batch = DecodeBatch([rid], [length], [metadata], last, position)
        else:
            batch = self._batch
            batch.request_ids.append(rid)
            batch.prompt_lengths.append(length)
            batch.metadata.append(metadata)
            batch.last_tokens = torch.cat([batch.last_tokens, last])
            batch.positions = torch.cat([batch.positions, position])
        self.running.append(request)
        self.engine.metrics(rid).mark("joined")

    def _decode_step(self) -> list[Event]:
        batch = self._batch
        assert batch is not None, "requests are running without a decode batch"
        try:
            _, logits = self.runner.step(batch)
        except RequestFailed as exc:
            return self._fail_broken(str(exc))
        # Requests whose fetch failed or timed out in this step (their prefill node lost or stalled) were
        # only marked: the step ran to its end for everyone, and now they leave; the others go on.
        events: list[Event] = []
        failed = self.engine.failed(batch.request_ids)
        if failed:
            keep = [b for b in range(len(self.running)) if b not in set(failed)]
            victims = [self.running[b] for b in failed]
            self._leave_batch(failed)
            for request in victims:
                rid = request.request_id
                error = self.engine.metrics(rid).error if self.engine.has_request(rid) else None
                events.append(self._abort(request, error or "its prefill node failed it", self._failure(rid)))
            if not self.running:
                return events
            logits = logits[keep]
        # Requests this step gave up waiting for: their step is taken back. One whose fetch stalled (past the stall
        # timeout) waits outside the batch until the fetch lands, so the others keep their pace; one held back for
        # its share of the step stays and redoes it in the next, its fetches landing meanwhile.
        held: set[str] = set()
        deferred = self.engine.deferred(batch.request_ids)
        if deferred:
            held = {batch.request_ids[b] for b in deferred if self.engine.held_back(batch.request_ids[b])}
            for rid in held:
                self.engine.undo_step(rid)
            parking = [b for b in deferred if batch.request_ids[b] not in held]
            if parking:
                gone = set(parking)
                keep = [b for b in range(len(self.running)) if b not in gone]
                parked = [self.running[b] for b in parking]
                self._leave_batch(parking)
                for request in parked:
                    self.engine.undo_step(request.request_id)
                self.parked += parked
                if not self.running:
                    return events
                logits = logits[keep]
        stepped = [b for b, request in enumerate(self.running) if request.request_id not in held]
        self.engine.end_step([self.running[b].request_id for b in stepped])
        if not stepped:
            return events
        tokens = torch.stack([self.running[b].sampler(logits[b : b + 1])[0] for b in stepped])
        done = []
        for i, b in enumerate(stepped):
            request = self.running[b]
            if request.keep_logits:
                request.logits.append(logits[b])
            events += self._emit(request, int(tokens[i]))
            if isinstance(events[-1], Finished):
                done.append(b)
        batch.advance(tokens, None if len(stepped) == len(self.running) else stepped)
        if done:
            self._leave_batch(done, finished=True)
        return events

    def _leave_batch(self, indices: list[int], *, finished: bool = False) -> None:
        """Takes the requests at `indices` out of the running batch (finished ones are already freed)."""
        gone = set(indices)
        keep = [b for b in range(len(self.running)) if b not in gone]
        assert self._batch is not None
        self._batch.drop(keep)
        self.running = [self.running[b] for b in keep]

    def _fail_broken(self, reason: str) -> list[Event]:
        """A prefill node died mid-step: fail the requests it served, keep the others."""
        broken = []
        for b, request in enumerate(self.running):
            rid = request.request_id
            if not self.engine.has_request(rid) or self.engine.metrics(rid).error:
                broken.append(b)
        if not broken:  # nobody to blame: fail the whole batch rather than loop forever
            broken = list(range(len(self.running)))
        victims = [self.running[b] for b in broken]
        self._leave_batch(broken)
        events: list[Event] = []
        for request in victims:
            rid = request.request_id
            error = self.engine.metrics(rid).error if self.engine.has_request(rid) else None
            events.append(self._abort(request, error or reason, self._failure(rid)))
        return events

    # -- per request -----------------------------------------------------------------------
    def _emit(self, request: DriverRequest, token: int) -> list[Event]:
        request.tokens.append(token)
        metrics = self.engine.metrics(request.request_id)
        event: Event = Token(request.request_id, token, len(request.tokens) - 1, metrics.token_times[-1])
        if request.stop(token):
            return [event, self._complete(request, "stop")]
        if len(request.tokens) >= request.max_tokens:
            return [event, self._complete(request, "length")]
        return [event]

    def _complete(self, request: DriverRequest, reason: str) -> Finished:
        metrics = self.engine.finish(request.request_id)
        return Finished(request.request_id, reason, None, metrics, request.tokens, request.logits)

    @staticmethod
    def takes_second(request: DriverRequest) -> bool:
        """It takes its second token from the forecast step (greedy there): its policy asks, it does not sample, and it
        does not keep each decoded token's logits (the FORECAST carries the token, not the logits)."""
        return request.policy.second_token and request.sampler.temperature == 0 and not request.keep_logits

    def _failure(self, request_id: str) -> str:
        """The kind of failure the engine recorded for a request: its prefill node had no room ("overloaded"), was
        lost with no other to take it ("unavailable"), or anything else ("error")."""
        if self.engine.was_overloaded(request_id):
            return "overloaded"
        return "unavailable" if self.engine.was_lost(request_id) else "error"

    def _abort(self, request: DriverRequest, reason: str, kind: str) -> Finished:
        rid = request.request_id
        if self.engine.has_request(rid):
            metrics = self.engine.metrics(rid)
            self.engine.abort(rid, reason)
        else:
            metrics = RequestMetrics(rid, request.prompt_ids.numel(), created=request.arrival)
        metrics.error = reason
        return Finished(rid, kind, reason, metrics, request.tokens, request.logits)
