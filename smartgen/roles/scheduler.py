"""The decode node's scheduler: admission, dispatch to prefill nodes, and continuous batching at step granularity.

A request's life on the decode node:
1. `submit()`: validated and queued (a bounded queue: refused with 429 when full, 413 when
   the prompt cannot fit a pool slot).
2. Dispatched when a pool slot is free: `DecodeEngine.open` takes the slot, sets the masks
   remote, picks the least-loaded prefill node and sends OPEN with the prompt ids.
3. Prefilling: proactive blocks land while the loop keeps decoding others; FIRST_TOKEN brings
   the first token (streamed: TTFT) and the selector metadata. Full transfer also waits until
   every block is local.
4. Decoding: the request joins the running batch at the next step boundary; each step emits
   one token per request (the first of them is TTST).
5. Finished (EOS, a stop token, max_tokens) or cancelled (client gone) or failed (prefill node
   lost, timeout): RELEASE or ABORT to the prefill node, pool slot freed, a FinishEvent with
   the usage and timings (or the reason) to the client.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from smartgen.engine.decode import DecodeEngine, RequestFailed
from smartgen.engine.policy import Policy, get_policy
from smartgen.engine.pool import PoolFull
from smartgen.roles.service import FinishEvent, GenerationParams, RequestHandle, ServiceError, TokenEvent
from smartgen.runtime.decode import DecodeBatch, DecodeRunner
from smartgen.runtime.sampling import Sampler

__all__ = ["DecodeScheduler"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Active:
    handle: RequestHandle
    prompt_ids: torch.Tensor
    params: GenerationParams
    policy: Policy
    sampler: Sampler
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    token_times: list[float] = field(default_factory=list)
    dispatched: float = 0.0


class DecodeScheduler:
    """Implements `DecodeService` over a DecodeEngine and a DecodeRunner, in one background thread."""

    def __init__(
        self,
        runner: DecodeRunner,
        tokenizer: Any,
        default_policy: Policy,
        model_name: str,
        *,
        max_waiting: int = 64,
        prefill_timeout: float = 300.0,
    ) -> None:
        self.runner = runner
        self.engine: DecodeEngine = runner.engine
        self.tokenizer = tokenizer
        self.default_policy = default_policy
        self.model_name = model_name
        self.prefill_timeout = prefill_timeout
        self._waiting: queue.Queue[_Active] = queue.Queue(maxsize=max_waiting)
        self._prefilling: list[_Active] = []
        self._running: list[_Active] = []
        self._batch: DecodeBatch | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="decode-scheduler", daemon=True)
        self.ready = False
        self.stop_reason = "decode node is shutting down"
        self._recent: deque[dict[str, Any]] = deque(maxlen=100)  # the last finished requests' usage, for /status

    # -- the service ---------------------------------------------------------------------
    def start(self) -> None:
        self.ready = True
        self._thread.start()

    def submit(self, prompt_ids: list[int], params: GenerationParams) -> RequestHandle:
        if self._stop.is_set():
            raise ServiceError("the decode node is shutting down", 503)
        if not prompt_ids:
            raise ServiceError("the prompt is empty")
        if params.max_tokens < 1:
            raise ServiceError("max_tokens must be at least 1")
        if len(prompt_ids) + params.max_tokens > self.engine.pool.max_tokens:
            raise ServiceError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"{self.engine.pool.max_tokens} tokens a pool slot holds",
                413,
            )
        try:
            policy = get_policy(params.scheme) if params.scheme else self.default_policy
            if params.scheme and policy.proactive == "budget" and self.default_policy.strategy != policy.strategy:
                policy = policy.with_strategy(self.default_policy.strategy)
            sampler = Sampler(params.temperature, params.top_p, params.seed if params.seed is not None else 0)
        except ValueError as exc:
            raise ServiceError(str(exc)) from None
        handle = RequestHandle(uuid.uuid4().hex, len(prompt_ids))
        active = _Active(handle, torch.tensor(prompt_ids, dtype=torch.int64), params, policy, sampler)
        try:
            self._waiting.put_nowait(active)
        except queue.Full:
            raise ServiceError("too many requests waiting; try again later", 429) from None
        self._wake.set()
        return handle

    def health(self) -> dict[str, Any]:
        return {
            "ready": self.ready and not self._stop.is_set(),
            "model": self.model_name,
            "prefill_nodes": len(self.engine._links),
            "running": len(self._running),
            "prefilling": len(self._prefilling),
            "waiting": self._waiting.qsize(),
            "free_slots": self.engine.pool.num_free,
        }

    def status(self) -> dict[str, Any]:
        """Engine counters, lane counters, and per request: state, timings and per-layer mask summary."""
        engine = self.engine
        requests = []
        for active in list(self._prefilling) + list(self._running):
            rid = active.handle.request_id
            if not engine.has_request(rid):
                continue
            entry = engine.metrics(rid).snapshot()
            try:
                entry["masks"] = [{"pad": p, "local": loc, "remote": r} for p, loc, r in engine.mask_summary(rid)]
            except Exception:  # a request failing right now has no masks to show
                entry["masks"] = []
            entry["scheme"] = active.policy.label
            requests.append(entry)
        return {
            "role": "decode",
            "model": self.model_name,
            "health": self.health(),
            "paths": engine.counters.snapshot(),
            "links": [
                {"push": link.push.counters.snapshot(), "control": link.control.counters.snapshot()}
                for link in engine._links
            ],
            "requests": requests,
            "recent": list(self._recent),
        }

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
        try:
            while not self._stop.is_set():
                self._reap_cancelled()
                self._dispatch()
                self._collect_first_tokens()
                if self._running:
                    self._step()
                else:
                    self._wake.wait(0.002)
                    self._wake.clear()
        except Exception as exc:  # the loop must never die silently: fail everyone, say why
            log.exception("decode scheduler crashed")
            self.stop_reason = f"decode scheduler failed: {exc}"
        finally:
            self._fail_all(self.stop_reason)

    def _dispatch(self) -> None:
        while self.engine.pool.num_free > 0:
            try:
                active = self._waiting.get_nowait()
            except queue.Empty:
                return
            if active.handle.cancelled:
                self._finish(active, "aborted", active.handle.cancel_reason)
                continue
            try:
                self.engine.open(
                    active.prompt_ids.numel(),
                    active.policy,
                    max_new_tokens=active.params.max_tokens,
                    request_id=active.handle.request_id,
                    prompt_ids=active.prompt_ids,
                )
            except (PoolFull, RuntimeError) as exc:
                self._finish(active, "error", str(exc))
                continue
            active.dispatched = time.monotonic()
            self._prefilling.append(active)

    def _collect_first_tokens(self) -> None:
        still = []
        for active in self._prefilling:
            rid = active.handle.request_id
            if not self.engine.first_token_ready(rid):
                if time.monotonic() - active.dispatched > self.prefill_timeout:
                    self._abort(active, f"no first token within {self.prefill_timeout:.0f} s")
                else:
                    still.append(active)
                continue
            try:
                if not active.tokens:
                    token = self.engine.wait_first_token(rid, timeout=0)
                    self._emit(active, token)
                    if self._done(active):
                        continue
                if active.policy.wait_for_all and not self.engine.is_all_local(rid):
                    still.append(active)  # full transfer: decoding starts when every block is here
                    continue
            except (RequestFailed, KeyError) as exc:
                self._abort(active, str(exc))
                continue
            self._join_batch(active)
        self._prefilling = still

    def _join_batch(self, active: _Active) -> None:
        rid = active.handle.request_id
        metadata = self.engine.request_metadata(rid)
        position = torch.tensor([active.prompt_ids.numel()], dtype=torch.int64)
        last = torch.tensor([active.tokens[-1]], dtype=torch.int64)
        if self._batch is None or not self._batch.request_ids:
            self._batch = DecodeBatch([rid], [active.prompt_ids.numel()], [metadata], last, position)
        else:
            batch = self._batch
            batch.request_ids.append(rid)
            batch.prompt_lengths.append(active.prompt_ids.numel())
            batch.metadata.append(metadata)
            batch.last_tokens = torch.cat([batch.last_tokens, last])
            batch.positions = torch.cat([batch.positions, position])
        self._running.append(active)

    def _running_batch(self) -> DecodeBatch:
        """The decode batch of the running requests: _join_batch makes it before the first one runs."""
        assert self._batch is not None, "requests are running without a decode batch"
        return self._batch

    def _step(self) -> None:
        batch = self._running_batch()
        try:
            _, logits = self.runner.step(batch)
        except RequestFailed as exc:
            # a prefill node died mid-step: fail the requests it served, keep the others
            self._fail_broken(str(exc))
            return
        self.engine.end_step(batch.request_ids)
        tokens = torch.stack([active.sampler(logits[b : b + 1])[0] for b, active in enumerate(self._running)])
        keep = []
        for b, active in enumerate(self._running):
            self._emit(active, int(tokens[b]))
            if not self._done(active):
                keep.append(b)
        batch.advance(tokens)
        if len(keep) < len(self._running):
            batch.drop(keep)
            self._running = [self._running[b] for b in keep]

    def _fail_broken(self, reason: str) -> None:
        keep = []
        for b, active in enumerate(self._running):
            rid = active.handle.request_id
            metrics = self.engine.metrics(rid) if self.engine.has_request(rid) else None
            if metrics is not None and metrics.error:
                self._abort(active, metrics.error)
            else:
                keep.append(b)
        if len(keep) == len(self._running):  # nobody to blame: fail the whole batch rather than loop forever
            for active in self._running:
                self._abort(active, reason)
            keep = []
        self._running_batch().drop(keep)
        self._running = [self._running[b] for b in keep]

    # -- per request ---------------------------------------------------------------------
    def _emit(self, active: _Active, token: int) -> None:
        now = time.monotonic()
        active.tokens.append(token)
        active.token_times.append(now)
        text = self.tokenizer.decode(active.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # half a multi-byte character: wait for the rest
            piece = ""
        else:
            piece, active.text = text[len(active.text) :], text
        active.handle.put(TokenEvent(token, piece, len(active.tokens) - 1, now))

    def _done(self, active: _Active) -> bool:
        """Finishes the request if its last token ends it; returns whether it did."""
        token = active.tokens[-1]
        params = active.params
        eos = self.tokenizer.eos_token_id
        if (not params.ignore_eos and eos is not None and token == eos) or token in params.stop_token_ids:
            self._complete(active, "stop")
            return True
        if len(active.tokens) >= params.max_tokens:
            self._complete(active, "length")
            return True
        return False

    def _complete(self, active: _Active, reason: str) -> None:
        rid = active.handle.request_id
        if self.engine.has_request(rid):
            self.engine.finish(rid)
        self._finish(active, reason, None)

    def _abort(self, active: _Active, reason: str) -> None:
        self.engine.abort(active.handle.request_id, reason)
        self._finish(active, "aborted" if active.handle.cancelled else "error", reason)

    def _finish(self, active: _Active, reason: str, error: str | None) -> None:
        times = active.token_times
        created = active.handle.created
        usage = {
            "prompt_tokens": active.handle.prompt_tokens,
            "completion_tokens": len(active.tokens),
            "total_tokens": active.handle.prompt_tokens + len(active.tokens),
            "ttft": times[0] - created if times else None,
            "ttst": times[1] - created if len(times) > 1 else None,
            "tbt": (times[-1] - times[1]) / (len(times) - 2) if len(times) > 2 else None,
            "scheme": active.policy.label,
        }
        self._recent.append({"request_id": active.handle.request_id, "finish_reason": reason, "error": error, **usage})
        active.handle.put(FinishEvent(reason, error, usage))

    def _reap_cancelled(self) -> None:
        for group in (self._prefilling, self._running):
            for active in [a for a in group if a.handle.cancelled]:
                self._abort(active, active.handle.cancel_reason)
                if group is self._running:
                    index = self._running.index(active)
                    self._running_batch().drop([b for b in range(len(self._running)) if b != index])
                group.remove(active)

    def _fail_all(self, reason: str) -> None:
        for active in self._prefilling + self._running:
            self._abort(active, reason)
        self._prefilling, self._running = [], []
        self._batch = None
        while True:
            try:
                active = self._waiting.get_nowait()
            except queue.Empty:
                break
            self._finish(active, "error", reason)
