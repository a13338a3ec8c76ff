"""The decode engine: a request's life on the decode node, from OPEN to RELEASE (the package docstring lists it)."""

from __future__ import annotations

import time
import uuid

import torch

import smartgen.engine.decode.decide as decide
from smartgen.engine import messages as msg
from smartgen.engine.decode.control import DecodeControl
from smartgen.engine.decode.progress import Arrival
from smartgen.engine.decode.request import DecodeRequest, RequestFailed
from smartgen.engine.index_ops import entry_status
from smartgen.engine.layout import DENSE_LAYERS
from smartgen.engine.mask import LOCAL
from smartgen.engine.metrics import RequestMetrics, RequestState
from smartgen.engine.policy import Policy

__all__ = ["DecodeEngine"]


class DecodeEngine(DecodeControl):
    """Owns the decode pool (`DecodePath`) and talks to the prefill nodes attached with `attach()` (`DecodeControl`)."""

    def close(self) -> None:
        self._closing = True
        for request_id in list(self._requests):
            self.abort(request_id, "decode engine closed")
        for link in self.links:  # a copy: each link's listener drops it from self._links as it sees it close
            link.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def open(
        self,
        length: int,
        policy: Policy,
        *,
        max_new_tokens: int = 0,
        request_id: str | None = None,
        prompt_ids: torch.Tensor | None = None,
        arrival: float | None = None,
        oracle_counts: torch.Tensor | None = None,
        head_tokens: int = 0,
    ) -> str:
        """Admits a request of `length` prompt tokens: slot, masks, lane, OPEN. Returns its id.

        `prompt_ids` travel with OPEN when the prefill node runs a model (serving). `arrival`
        (time.monotonic(), default now) is when the request arrived: its TTFT and TTST count from it.
        `oracle_counts` ([L, n]): a recorded run's selection counts, for the "optimal" proactive set.
        `head_tokens`: output tokens past the second its prefill node may decode ahead (Policy.head_start; 0: none).
        """
        request_id = request_id or uuid.uuid4().hex
        link = self._pick_link(prompt_ids)  # before the slot: with no live prefill node the request fails at once
        slot = self.pool.allocate(length, max_new_tokens, quantized=bool(policy.quantize_bits))
        # a quantized transfer lands whole layers (lossy): it neither takes from nor gives to the prefix cache
        held = self._fill_from_cache(slot, prompt_ids) if prompt_ids is not None and not policy.quantize_bits else 0
        message = msg.Open(
            request_id,
            slot,
            length,
            policy.name,
            policy.strategy,
            policy.speculative_ratio,
            prompt_ids,
            held_prefix=held,
            oracle_counts=oracle_counts,
            head_tokens=head_tokens if policy.head_start else 0,
        )
        per_token = self.layout.num_layers * self.layout.num_kv_heads  # KV entries of one prompt token
        request = DecodeRequest(
            request_id,
            slot,
            length,
            link,
            policy,
            RequestMetrics(
                request_id, length, RequestState.DISPATCHED, created=time.monotonic() if arrival is None else arrival
            ),
            fetch_counts=torch.zeros(self.layout.num_layers, length, self.layout.num_kv_heads, dtype=torch.int32),
            metadata=[{} for _ in range(self.layout.num_layers)],
            open_message=message,
            arrival=Arrival(per_token * length, next(self._dispatch_order), time.monotonic(), per_token * held),
        )
        request.metrics.held_tokens = held
        with self._lock:
            self._requests[request_id] = request
        link.push.accept(request_id, self.pool.geometry.slot_extents(slot, length))
        link.control.send(message.pack())
        request.metrics.state = RequestState.PREFILLING
        if not link.alive:  # closed under us: OPEN went nowhere, so fail (or re-open) now rather than wait
            reason = link.error or "connection closed"
            self._fail_link(link, reason)
            mine = self._claim_orphan(request, link)  # the listener may have taken it as it dropped the link
            if mine and not request.metrics.error and not (self.recompute and self._reopen(request)):
                self._fail_request(
                    request_id, f"prefill node connection lost: {reason}", lost=True
                )  # the link was dropped just before
        return request_id

    def wait_first_token(self, request_id: str, timeout: float | None = None) -> int:
        request = self._require(request_id)
        try:
            token = request.first_token.result(timeout=timeout)
        except TimeoutError:
            raise RequestFailed(f"no first token for {request_id} within {timeout} s") from None
        # the node's TTFT counts to the token's arrival, when the scheduler streams it, not to this later collection
        request.metrics.record_token(request.first_token_at or time.monotonic())
        request.metrics.state = RequestState.DECODING
        return token

    def first_token_ready(self, request_id: str) -> bool:
        """Non-blocking: has FIRST_TOKEN (or a failure) arrived?"""
        return self._require_any(request_id).first_token.done()

    def request_metadata(self, request_id: str) -> list[dict[str, torch.Tensor]]:
        """Its selection metadata per layer, failed or not: the driver joins a request to the batch after checking
        it, and a request failed since then leaves at the step's `failed` check."""
        return self._require_any(request_id).metadata

    # -- the first step's forecast (Policy.forecast) ------------------------------------------
    def forecast_pending(self, request_id: str, *, after_second: bool = False) -> bool:
        """FIRST_TOKEN promised a FORECAST that has not come yet (False once the request failed). `after_second`:
        the one of the step after the second token, which a FORECAST that brought that token promised."""
        request = self._require_any(request_id)
        if after_second:
            waiting = request.forecast_next_promised and request.forecast_next is None
        else:
            waiting = request.forecast_promised and request.forecast is None
        return waiting and not request.forecast_taken and not request.metrics.error

    def take_forecast(self, request_id: str, *, after_second: bool = False) -> dict[int, torch.Tensor] | None:
        """The forecast's queries per layer, once (None when none came, or they were taken): the first decode step's,
        or with `after_second` those of the step after the second token, or where that forecast came empty (its
        prefill node gave the step up for a waiting prompt, or it failed) the second token's step's, whose picks
        mostly recur one step on. Either way, none is taken after."""
        request = self._require_any(request_id)
        queries = (request.forecast_next or request.forecast) if after_second else request.forecast
        request.forecast = request.forecast_next = None
        if queries is not None:
            request.forecast_taken = True
        return queries

    def fetch_forecast(self, layer: int, request_id: str, index: torch.Tensor) -> int:
        """Fetches the remote entries of a forecast selection ([H, k], one request's rows) at low priority (their
        replies go after running requests' fetch replies), in FETCHes of a few ms of link each
        (`decide.forecast_chunk`); they are in flight like a prefetch's, so the step that selects them waits for them
        instead of asking again. Returns the entries asked for."""
        request = self._require_any(request_id)
        if not request.live or request.flags.drop_remote:
            return 0
        self.pool.sync_staged(layer, [request.slot])
        slots = torch.tensor([request.slot], dtype=torch.int64, device=index.device)
        status = entry_status(index, self.pool.masks.layer(layer).to(index.device), slots, self.layout.num_kv_heads)
        entries = decide.remote_entries(index, status)
        if not entries.numel():
            return 0
        if request.flags.attend_remote:  # its step attends to what has not come: the push brings the picks next
            self.hint_entries(request, layer, entries)
            request.metrics.forecast_entries += int(entries.numel())
            return int(entries.numel())
        entry_bytes = 2 * self.layout.token_bytes // self.layout.num_kv_heads
        for chunk in entries.split(decide.forecast_chunk(entry_bytes, request.link.pacer.bytes_per_second)):
            request.late.append((layer, chunk, self._send_fetch(request, layer, chunk, "forecast"), time.monotonic()))
        request.metrics.forecast_entries += int(entries.numel())
        request.metrics.mark("forecast_asked")
        return int(entries.numel())

    def take_second_token(self, request_id: str) -> int | None:
        """The second token a FORECAST brought (Policy.second_token), once: the first token's K/V go into the pool
        (local at once) and the token counts as arrived when the FORECAST did; the request's next step decodes the
        third token. None when none came (or it was taken). Call it only before the request's first step."""
        request = self._require(request_id)
        second, request.second = request.second, None
        if second is None:
            return None
        if len(request.metrics.token_times) != 1:
            raise RuntimeError(f"{request_id}: a second token is taken after the first token, before any step")
        for layer in range(self.layout.num_layers):
            self.append(layer, request_id, second.keys[layer], second.values[layer])
        request.metrics.record_token(request.second_at)
        request.metrics.prefill_tokens = 2
        return second.token

    def head_pending(self, request_id: str) -> bool:
        """Its prefill node may still decode tokens ahead for it (Policy.head_start): OPEN allowed some, and the
        step-2 FORECAST that ends them has not come (False once the request failed or its prefill node was lost)."""
        request = self._require_any(request_id)
        message = request.open_message
        if message is None or not message.head_tokens or request.metrics.error or request.resuming:
            return False
        if not request.forecast_next_promised:  # until the step-1 FORECAST says whether a second token came
            return request.forecast_promised and request.forecast is None and not request.forecast_taken
        return not request.head_done

    def take_head_token(self, request_id: str) -> int | None:
        """The next token its prefill node decoded ahead (Policy.head_start), once, after the second token was
        taken: the K/V of the token before it go into the pool and it counts as arrived when its FORECAST did. None
        when none is waiting."""
        request = self._require(request_id)
        if not request.head or len(request.metrics.token_times) < 2:
            return None
        head, at = request.head.pop(0)  # the link's thread appends: pop and append are atomic
        for layer in range(self.layout.num_layers):
            self.append(layer, request_id, head.keys[layer], head.values[layer])
        request.metrics.record_token(at)
        request.metrics.prefill_tokens += 1
        return head.token

    def forecast_landed(self, request_id: str) -> bool:
        """Every fetch in flight for the request has its reply (or it failed): its first step will not wait."""
        request = self._require_any(request_id)
        if request.metrics.error:
            return True
        landed = all(future.done() for _, _, future, _ in request.late)
        if landed and "forecast_asked" in request.metrics.milestones:
            request.metrics.mark("forecast_landed")
        return landed

    def dense_layers_local(self, request_id: str) -> bool:
        """Layers 0-1 of the request (pushed whole during its prefill) are all in the pool, or it failed: a request
        joining a running batch waits for them outside it (a step would wait for them, and the batch with it)."""
        request = self._require_any(request_id)
        if request.metrics.error or request.flags.drop_remote:
            return True
        self.pool.sync_staged(None, [request.slot])
        # read from each layer's local prefix on (the mask table remembers it), not the whole of both layers
        local = self.pool.masks.spans_local(range(DENSE_LAYERS), request.slot, 0, request.length, all_of=True)[0]
        if local:
            request.metrics.mark("dense_local")
        return local

    def is_all_local(self, request_id: str) -> bool:
        request = self._require(request_id)
        try:
            return self._fully_local(request)
        except ValueError as exc:  # a quantized layer that does not unpack: the peer sent something else
            reason = f"bad quantized KV from the prefill node: {exc}"
            self._fail_request(request_id, reason)
            raise RequestFailed(reason) from None

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def was_overloaded(self, request_id: str) -> bool:
        """The request failed because its prefill node had no room for it (store or queue full)."""
        request = self._requests.get(request_id)
        return request is not None and request.overloaded

    def was_lost(self, request_id: str) -> bool:
        """The request failed because its prefill node was lost (dead, silent past its lease) and none took it."""
        request = self._requests.get(request_id)
        return request is not None and request.lost

    def failed(self, request_ids: list[str]) -> list[int]:
        """Indices (into `request_ids`) of requests that failed and must leave the batch."""
        return [
            i for i, rid in enumerate(request_ids) if rid not in self._requests or self._requests[rid].metrics.error
        ]

    def wait_all_local(self, request_id: str, timeout: float | None = None, poll: float = 0.0005) -> None:
        """Blocks until every prompt block of the request is in the pool (full transfer)."""
        request = self._require(request_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_all_local(request_id):
            if request.metrics.error:
                raise RequestFailed(request.metrics.error)
            if deadline is not None and time.monotonic() > deadline:
                raise RequestFailed(f"KV of {request_id} did not arrive within {timeout} s")
            time.sleep(poll)

    def _fill_from_cache(self, slot: int, prompt_ids: torch.Tensor) -> int:
        """Copies the prompt's cached leading blocks into the slot, local in every layer; returns their tokens."""
        hit = self.prefix_cache.match(prompt_ids)
        if hit is None:
            return 0
        try:
            k, v = hit.kv()
            held = hit.tokens
            self.pool.k[:, slot, :held] = k.to(self.pool.k.device)
            self.pool.v[:, slot, :held] = v.to(self.pool.v.device)
            self.pool.masks.values[:, slot, :held] = LOCAL  # after the data, as a push does
        finally:
            self.prefix_cache.release(hit)
        self.held_bytes += self.layout.kv_bytes(held)
        return held

    def _cache_prompt(self, request: DecodeRequest) -> None:
        """A finished request's leading prompt blocks that are local in every layer and head go to the prefix cache,
        whether or not the rest of the prompt arrived (only the prompt: generated tokens' K/V come from sparse decode
        steps, not from prefill)."""
        prompt = request.open_message.prompt_ids if request.open_message is not None else None
        if prompt is None or not self.prefix_cache.enabled or request.flags.quantized:
            return
        # whatever is wholly local counts, however little of the rest arrived (a short answer under speculation ends
        # early); staged landings are moved in first, or a GPU pool would leave out what the host already holds
        self.pool.sync_staged(None, [request.slot])
        local = self.pool.masks.local_prefix(request.slot, request.length)
        local -= local % self.prefix_cache.block_tokens
        if local:
            k, v = self.pool.k[:, request.slot, :local], self.pool.v[:, request.slot, :local]
            self.prefix_cache.insert(prompt[:local], k, v)

    def end_step(self, request_ids: list[str]) -> None:
        """After a step: record the token, and RELEASE requests whose blocks are now all local.

        A request whose prefill node was lost after the driver's `failed` check still had its step computed: its
        token counts, and it leaves at the next check (its link's thread may fail it at any moment)."""
        now = time.monotonic()
        for request_id in request_ids:
            request = self._require_any(request_id)
            self.count_step_selections(request)  # before the token: its union bytes are the step's
            request.metrics.record_token(now)
            request.deferred_since = None
            request.step_wait_s = 0.0
            request.remote_layers = None  # pushes and fetches landed during the step: scan again next step
            request.remote_met_before, request.remote_met = request.remote_met, set()
        self.release_fully_local(request_ids)

    def release_fully_local(self, request_ids: list[str]) -> list[str]:
        """Sends RELEASE for speculative requests whose blocks are all local; returns their ids."""
        released = []
        for request_id in request_ids:
            request = self._require_any(request_id)  # failed since the step's check: nothing to release on its link
            if request.released or not request.flags.speculative or request.metrics.error:
                continue
            self.pool.sync_staged(None, [request.slot])
            if self.pool.masks.all_local(request.slot, request.length):
                self._release(request, msg.Release(request_id))
                request.metrics.state = RequestState.FULLY_LOCAL
                request.metrics.fully_local_at = time.monotonic()
                request.metrics.mark("fully_local", request.metrics.fully_local_at)
                released.append(request_id)
        return released

    def is_released(self, request_id: str) -> bool:
        return self._require(request_id).released

    def _release(self, request: DecodeRequest, message: msg.Release | msg.Abort) -> None:
        if request.released:
            return
        request.released = True
        request.link.control.send(message.pack())

    def finish(self, request_id: str) -> RequestMetrics:
        """The request is done: stop its writes, free its slot, release it on the prefill node. Its last token was
        computed, so it finishes even where its prefill node was lost meanwhile (the RELEASE then goes nowhere)."""
        request = self._require_any(request_id)
        request.link.push.revoke(request_id)
        request.link.control.drop_landings(request_id)
        self._release(request, msg.Release(request_id))
        self._cache_prompt(request)
        self._hand_on_progress(request)
        self.pool.free(request.slot)
        request.metrics.state = RequestState.FINISHED
        with self._lock:
            self._requests.pop(request_id, None)
        return request.metrics

    def abort(self, request_id: str, reason: str) -> None:
        """The request failed: same clean-up as `finish`, with ABORT and the reason."""
        request = self._requests.get(request_id)
        if request is None:
            return
        request.link.push.revoke(request_id)
        request.link.control.drop_landings(request_id)
        self._release(request, msg.Abort(request_id, reason))
        self._hand_on_progress(request)
        self.pool.free(request.slot)
        request.metrics.state = RequestState.ABORTED
        request.metrics.error = reason
        with self._lock:
            self._requests.pop(request_id, None)

    def _require(self, request_id: str) -> DecodeRequest:
        request = self._requests.get(request_id)
        if request is None:
            raise KeyError(f"unknown request {request_id!r}")
        if request.metrics.error:
            raise RequestFailed(request.metrics.error)
        return request

    # -- what the monitor reads ---------------------------------------------------------
    def slot_of(self, request_id: str) -> int:
        return self._require(request_id).slot

    def fetch_counts(self, request_id: str) -> torch.Tensor:
        return self._require(request_id).fetch_counts

    def metrics(self, request_id: str) -> RequestMetrics:
        return self._requests[request_id].metrics

    def mask_summary(self, request_id: str) -> list[tuple[int, int, int]]:
        """Per layer (pad, local, remote) counts of one request's mask."""
        slot = self._require(request_id).slot
        summaries = (self.pool.masks.summary(layer, slot) for layer in range(self.layout.num_layers))
        return [(pad, local, remote) for pad, local, remote in summaries]
