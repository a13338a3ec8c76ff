"""The decode node's scheduler: admission, dispatch to prefill nodes, and continuous batching at step granularity.

A request's life on the decode node:
1. `submit()`: validated (roles.admission: 400 for bad ids, 413 over the model's context or a
   pool slot; 503 with no live prefill node) and queued (a bounded queue: 503 with the reason
   when full). A refused request changes nothing on either node.
2. Dispatched when a pool slot is free: handed to the decode driver (`runtime.driver`), which
   opens it on the engine (slot, masks remote, OPEN to the prefill node roles.placement chooses: least queued
   prompt tokens, less what its prefix cache likely holds of this prompt).
3.-4. The driver's lifecycle: prefilling, first token (streamed: TTFT), joining the running
   batch at a step boundary, one token per step (the first of them is TTST).
5. Finished (EOS, a stop token, max_tokens) or cancelled (client gone) or failed (prefill node
   lost, timeout): the driver frees it on both nodes; a FinishEvent with the usage, read from
   the engine's metrics (the same numbers /status shows), goes to the client.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from smartgen.engine.decode import DecodeEngine
from smartgen.engine.metrics import RequestMetrics
from smartgen.engine.policy import Policy, check_servable, get_policy, split_label
from smartgen.lanes.thread_priority import unbatch_this_thread
from smartgen.roles.admission import RequestLimits, check_request, oracle_counts
from smartgen.roles.cpu_timeline import process_cpu_timeline
from smartgen.roles.service import FinishEvent, GenerationParams, RequestHandle, ServiceError, TokenEvent
from smartgen.roles.text_pieces import text_piece
from smartgen.roles.thread_cpu import thread_cpu_seconds, thread_policies
from smartgen.runtime.decode import DecodeRunner
from smartgen.runtime.driver import DecodeDriver, DriverRequest, Event, Finished, Token
from smartgen.runtime.sampling import Sampler

__all__ = ["DecodeScheduler"]

log = logging.getLogger(__name__)


# The step thread lets the GIL go at every wait inside a step (a fetch, a GPU sync, an emulated layer's sleep), and
# the node's other threads (lane receivers landing replies and pushes, the prefetch worker, HTTP) may then keep it
# until Python's switch interval (5 ms by default) makes them yield; py-spy showed the step thread waiting for the
# GIL after its layers' waits. With 0.5 ms (one run each way, random:32, docs/results/2026-12-02-optimal-proactive-set.md) partial
# transfer's step beyond its fetch waits fell from 21 to 5 ms over full's; smartgen's did not move.
STEP_SWITCH_INTERVAL_S = 0.0005


@dataclass(slots=True)
class _Active:
    handle: RequestHandle
    request: DriverRequest
    text: str = ""
    selection_counts: bool = False  # usage.selection_counts asked for
    skip_special: bool = True  # special tokens add no text (GenerationParams.skip_special_tokens)
    held: int = 0  # tokens in a row whose text waits for the rest of a character (`text_piece`)
    streamed: int = 0  # tokens put on the handle: the first may go from the link's thread, ahead of the driver
    early: list[int] = field(
        default_factory=list
    )  # the tokens the link's thread streamed as they arrived (first, second, head start)
    lock: threading.Lock = field(default_factory=threading.Lock)


class DecodeScheduler:
    """Implements `DecodeService` over a DecodeDriver, in one background thread."""

    def __init__(
        self,
        runner: DecodeRunner,
        tokenizer: Any,
        default_policy: Policy,
        model_name: str,
        *,
        max_waiting: int = 64,
        prefill_timeout: float = 120.0,
        queue_timeout: float = 300.0,
        peers: Callable[[], list[dict[str, Any]]] | None = None,
    ) -> None:
        """`queue_timeout`: a request that waits this long for a free pool slot fails as overloaded (503)."""
        self.driver = DecodeDriver(runner, prefill_timeout=prefill_timeout)
        self.queue_timeout = queue_timeout
        self.engine: DecodeEngine = runner.engine
        self.engine.on_first_token = self._first_token_arrived
        self.engine.on_second_token = self._second_token_arrived
        self.tokenizer = tokenizer
        self.default_policy = default_policy
        self.model_name = model_name
        self.peers = peers  # per prefill node: address, state, last error (for /health)
        self.limits = RequestLimits.of(runner.model.config, self.engine.pool.max_tokens)
        self.max_waiting = max_waiting  # requests that may wait for a pool slot (then 503)
        self._waiting: queue.Queue[_Active] = queue.Queue(maxsize=max_waiting)
        self._active: dict[str, _Active] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="decode-scheduler", daemon=True)
        self.ready = False
        self.stop_reason = "decode node is shutting down"
        self.failure: str | None = None  # the loop crashed: every request is refused with this until a restart
        self._recent: deque[dict[str, Any]] = deque(maxlen=100)  # the last finished requests' usage, for /status
        # monitoring hangs here (roles.monitoring): called with (reason, metrics) / with the status snapshot
        self.finish_listeners: list[Callable[[str, RequestMetrics | None], None]] = []
        self.status_hooks: list[Callable[[dict[str, Any]], None]] = []

    # -- the service ---------------------------------------------------------------------
    def start(self) -> None:
        self.ready = True
        sys.setswitchinterval(min(sys.getswitchinterval(), STEP_SWITCH_INTERVAL_S))
        process_cpu_timeline()  # its threads' CPU, second by second, from now (`cpu_timeline`)
        self._thread.start()

    def submit(self, prompt_ids: list[int], params: GenerationParams) -> RequestHandle:
        if self.failure is not None:
            raise ServiceError(f"the decode node cannot serve ({self.failure}); restart it", 503)
        if self._stop.is_set():
            raise ServiceError("the decode node is shutting down", 503)
        check_request(prompt_ids, params, self.limits)
        try:
            policy = get_policy(params.scheme) if params.scheme else self.default_policy
            explicit = params.scheme is not None and split_label(params.scheme)[1] is not None
            if params.scheme and not explicit and policy.proactive == "budget":  # the node's strategy by default
                policy = policy.with_strategy(self.default_policy.strategy)
            if policy.speculative:  # the node's --speculative-ratio holds for every scheme that speculates
                policy = replace(policy, speculative_ratio=self.default_policy.speculative_ratio)
            check_servable(policy, oracle=params.proactive_counts is not None, head_dim=self.engine.layout.head_dim)
            oracle = None
            if params.proactive_counts is not None:
                if policy.strategy != "optimal":
                    raise ValueError(f"proactive_counts is for the optimal proactive set, not scheme {policy.label!r}")
                oracle = oracle_counts(params.proactive_counts, self.engine.layout.num_layers, len(prompt_ids))
            sampler = Sampler(params.temperature, params.top_p, params.seed if params.seed is not None else 0)
        except ValueError as exc:
            raise ServiceError(str(exc)) from None
        # after the input checks: a bad request is the client's to fix whether or not a prefill node is up
        if not self.engine.links:
            raise ServiceError("no prefill node is connected (see /health); try again later", 503)
        handle = RequestHandle(uuid.uuid4().hex, len(prompt_ids))
        request = DriverRequest(
            handle.request_id,
            torch.tensor(prompt_ids, dtype=torch.int64),
            policy,
            params.max_tokens,
            sampler,
            stop=self._stop_check(params),
            arrival=handle.created,
            oracle_counts=oracle,
        )
        try:
            self._waiting.put_nowait(
                _Active(
                    handle,
                    request,
                    selection_counts=params.return_selection_counts,
                    skip_special=params.skip_special_tokens,
                )
            )
        except queue.Full:
            raise ServiceError(
                f"overloaded: {self._waiting.maxsize} requests already wait for one of the "
                f"{self.engine.pool.num_slots} pool slots; try again later",
                503,
            ) from None
        self._wake.set()
        return handle

    def _stop_check(self, params: GenerationParams) -> Callable[[int], bool]:
        eos = self.tokenizer.eos_token_id
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos and eos is not None:
            stop_ids.add(eos)
        return stop_ids.__contains__

    def health(self) -> dict[str, Any]:
        live = len(self.engine.links)
        report = {
            "ready": self.ready and not self._stop.is_set() and live > 0,
            "model": self.model_name,
            "prefill_nodes": live,
            "running": len(self.driver.running),
            "prefilling": len(self.driver.prefilling),
            "parked": len(self.driver.parked),  # out of the batch, waiting for a late fetch (--fetch-stall-ms)
            "waiting": self._waiting.qsize(),
            "free_slots": self.engine.pool.num_free,
            "active_tokens": self._active_tokens(),  # the load the SGLang router's power-of-two policy compares
        }
        if self.failure is not None:
            report["error"] = self.failure  # not ready for good: a supervisor restarts the node
        if self.peers is not None:
            report["peers"] = self.peers()
        return report

    def _active_tokens(self) -> int:
        """Prompt and generated tokens of the dispatched requests (read off the scheduler's thread: a dict that
        changes size while it is copied is copied again)."""
        for _ in range(3):
            try:
                actives = list(self._active.values())
            except RuntimeError:
                continue
            return sum(a.request.prompt_ids.numel() + len(a.request.tokens) for a in actives)
        return 0

    def status(self) -> dict[str, Any]:
        """Engine counters, lane counters, and per request: state, timings and per-layer mask summary."""
        engine = self.engine
        requests = []
        for request in list(self.driver.prefilling) + list(self.driver.running) + list(self.driver.parked):
            rid = request.request_id
            if not engine.has_request(rid):
                continue
            entry = engine.metrics(rid).snapshot()
            try:
                entry["masks"] = [{"pad": p, "local": loc, "remote": r} for p, loc, r in engine.mask_summary(rid)]
            except Exception:  # a request failing right now has no masks to show
                entry["masks"] = []
            entry["scheme"] = request.policy.label
            requests.append(entry)
        snapshot = {
            "role": "decode",
            "model": self.model_name,
            "health": self.health(),
            "paths": engine.counters.snapshot(),
            "links": [
                {"push": link.push.counters.snapshot(), "control": link.control.counters.snapshot()}
                for link in engine.links
            ],
            "requests": requests,
            "recent": list(self._recent),
            # CPU seconds of this node's threads by role: what shares its CPUs with the decode step (`thread_cpu`)
            "threads_cpu": thread_cpu_seconds(),
            # and their scheduling policies: in `serve --role decode` the step thread alone "other" (thread_priority)
            "threads_policy": thread_policies(),
            # the same, second by second, in milliseconds (`cpu_timeline`; sampled from the node's start)
            "cpu_timeline": process_cpu_timeline().snapshot(),
        }
        for hook in self.status_hooks:
            hook(snapshot)
        return snapshot

    def stop(self, reason: str = "decode node is shutting down", timeout: float = 10.0) -> None:
        """Stops the loop; every request still in flight fails with `reason`."""
        self.stop_reason = reason
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.ready = False

    # -- the loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        # the decode step: in a batched process (`serve --role decode`) the one thread that preempts the others
        unbatch_this_thread()
        try:
            while not self._stop.is_set():
                self._deliver(self._reap_cancelled())
                self._expire_waiting()
                self._deliver(self._dispatch())
                if self.driver.num_active:
                    self._deliver(self.driver.step())
                if not self.driver.running:
                    self._wake.wait(0.002)
                    self._wake.clear()
        except Exception as exc:  # the loop must never die silently: fail everyone, say why, refuse what comes
            log.exception("decode scheduler crashed")
            self.stop_reason = self.failure = f"decode scheduler failed: {exc}"
            self.ready = False
        finally:
            self._deliver(self.driver.cancel_all(self.stop_reason, "unavailable"))
            self._fail_waiting(self.stop_reason)

    def _dispatch(self) -> list[Event]:
        events: list[Event] = []
        while self.engine.pool.num_free > 0:
            try:
                active = self._waiting.get_nowait()
            except queue.Empty:
                break
            if active.handle.cancelled:
                self._finish(active, "aborted", active.handle.cancel_reason, None)
                continue
            self._active[active.handle.request_id] = active
            events += self.driver.add(active.request)
        return events

    def _expire_waiting(self) -> None:
        """Fails the requests that waited longer than `queue_timeout` for a pool slot (503: try again later)."""
        if self._waiting.empty():
            return
        now = time.monotonic()
        with self._waiting.mutex:  # in place, keeping the others' order: a queue.Queue has no remove
            expired = [a for a in self._waiting.queue if now - a.request.arrival > self.queue_timeout]
            for active in expired:
                self._waiting.queue.remove(active)
            self._waiting.not_full.notify(len(expired))
        for active in expired:
            reason = (
                f"overloaded: waited {self.queue_timeout:g} s for one of the {self.engine.pool.num_slots} pool "
                "slots; try again later"
            )
            self._finish(active, "overloaded", reason, None)

    def _reap_cancelled(self) -> list[Event]:
        events: list[Event] = []
        for rid, active in list(self._active.items()):
            if active.handle.cancelled:
                events += self.driver.cancel(rid, active.handle.cancel_reason)
        return events

    def _first_token_arrived(self, request_id: str, token: int, arrived: float) -> None:
        """On the link's thread: a first token goes to its client at once, not after the batch step running now (which
        may wait seconds for the link); the driver's own event for it is then skipped."""
        active = self._active.get(request_id)
        if active is not None:
            active.early = [token]
            self._stream(active, Token(request_id, token, 0, arrived), [token])

    def _second_token_arrived(self, request_id: str, token: int, arrived: float) -> None:
        """On the link's thread: a second token from the forecast step (Policy.second_token), and each token of the
        prefill node's head start after it (Policy.head_start), goes to its client at once too, when the request
        takes them (the driver's rule: greedy); the driver's own events for them are skipped."""
        active = self._active.get(request_id)
        if active is not None and active.early and self.driver.takes_second(active.request):
            active.early.append(token)
            self._stream(active, Token(request_id, token, len(active.early) - 1, arrived), list(active.early))

    def _stream(self, active: _Active, event: Token, tokens: list[int]) -> None:
        """Puts one token's text piece on the handle, once and in order, whichever thread gets there first."""
        with active.lock:
            if event.index != active.streamed:
                return  # already streamed (the first token, from the link's thread)
            text = self.tokenizer.decode(tokens[: event.index + 1], skip_special_tokens=active.skip_special)
            piece, active.text, active.held = text_piece(text, active.text, active.held)  # half characters wait
            active.streamed += 1
            active.handle.put(TokenEvent(event.token, piece, event.index, event.time))

    def _deliver(self, events: list[Event]) -> None:
        """Turns the driver's events into the client's: text pieces as tokens arrive, usage at the end."""
        for event in events:
            active = self._active.get(event.request_id)
            if active is None:
                continue
            if isinstance(event, Token):
                self._stream(active, event, active.request.tokens)
            elif isinstance(event, Finished):
                del self._active[event.request_id]
                with active.lock:
                    active.streamed = -1  # nothing streams after the end, not even a first token arriving late
                self._finish(active, event.reason, event.error, event.metrics)

    def _finish(self, active: _Active, reason: str, error: str | None, metrics: RequestMetrics | None) -> None:
        tokens = active.request.tokens
        usage = {
            "prompt_tokens": active.handle.prompt_tokens,
            "completion_tokens": len(tokens),
            "total_tokens": active.handle.prompt_tokens + len(tokens),
            "ttft": metrics.ttft if metrics else None,
            "ttst": metrics.ttst if metrics else None,
            "tbt": metrics.tbt if metrics else None,
            "scheme": active.request.policy.label,
            "on_demand_ratio": metrics.on_demand_ratio if metrics else None,
            "fetched_tokens": metrics.fetched_tokens if metrics else None,
            "prefetched_entries": metrics.prefetched_entries if metrics else None,
            # (token, head) entries the forecast's picks asked for before the first step, a joiner's wait to join
            "forecast_entries": metrics.forecast_entries if metrics else None,
            # the first decode step's selection already local, and the time decoding waited for the link
            "first_step_coverage": metrics.first_step_coverage if metrics else None,
            "first_step_foreseen": metrics.first_step_foreseen if metrics else None,
            "first_step_wait": metrics.first_step_wait_s if metrics else None,
            # output tokens the prefill node computed: 2 when the forecast step's token was the second
            "prefill_tokens": metrics.prefill_tokens if metrics else None,
            "fetch_wait": metrics.fetch_wait_s if metrics else None,
            # entries decode steps fetched themselves, and of those the ones an earlier idle notice had hinted
            "step_fetched": metrics.step_fetched if metrics else None,
            "step_fetched_hinted": metrics.step_fetched_hinted if metrics else None,
            # entries decode steps attended where they were instead of fetching them (smartgen-attend)
            "step_attended": metrics.step_attended if metrics else None,
            # steps taken back and redone: a fetch past --fetch-stall-ms parked it, or it was held back for its share
            "deferred_steps": metrics.deferred_steps if metrics else None,
            # OpenAI's field: prompt tokens whose prefill a cache saved; held_tokens: KV the decode node already had
            "prompt_tokens_details": {"cached_tokens": metrics.prefill_cached_tokens} if metrics else None,
            "held_tokens": metrics.held_tokens if metrics else None,
        }
        self._recent.append({"request_id": active.handle.request_id, "finish_reason": reason, "error": error, **usage})
        for listener in self.finish_listeners:
            try:
                listener(reason, metrics)
            except Exception:  # monitoring must never fail a request
                log.exception("finish listener failed")
        # each token's arrival (CTL) goes to the client only when asked for (`return_token_times`)
        # per token: its arrival, and the bytes of distinct entries selected by then (the bench's CTL bound)
        # and the request's timeline on the decode node: its milestones (seconds from arrival) and each token's wait
        per_token = (
            {
                "ctl": metrics.ctl,
                "selection_union_bytes": metrics.union_bytes_at_token,
                "milestones": metrics.timeline(),
                "token_waits": metrics.token_waits,
            }
            if metrics
            else {}
        )
        if active.selection_counts:
            per_token["selection_counts"] = _selection_counts(
                metrics, self.engine.layout.num_layers, active.handle.prompt_tokens
            )
        active.handle.put(FinishEvent(reason, error, {**usage, **per_token}))

    def _fail_waiting(self, reason: str) -> None:
        while True:
            try:
                active = self._waiting.get_nowait()
            except queue.Empty:
                break
            self._finish(active, "unavailable", reason, None)  # the decode node is stopping


def _selection_counts(metrics: RequestMetrics | None, num_layers: int, prompt_tokens: int) -> list[list[int]]:
    """usage.selection_counts: how many decode steps selected each prompt token, per layer, summed over KV heads
    ([layers][prompt tokens]; layers 0-1, always moved whole, and a request that never selected are all zeros)."""
    counts = metrics.selection_counts if metrics is not None else None
    if counts is None:
        return [[0] * prompt_tokens for _ in range(num_layers)]
    return counts.sum(dim=2).tolist()
