"""The decode side's link and failure control: prefill nodes attached, lost and replaced; requests failed or parked."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TypeVar

import torch

from smartgen.engine import messages as msg
from smartgen.engine.decode.move import DecodePath
from smartgen.engine.decode.progress import Stall, judge, landed_entries
from smartgen.engine.decode.request import DecodeRequest, LinkLost, RequestFailed
from smartgen.engine.layout import KVLayout
from smartgen.engine.mask import LOCAL
from smartgen.engine.prefix_cache import PrefixCache
from smartgen.lanes.link import LinkEnd

__all__ = ["DecodeControl", "LinkLoad"]

_Key = TypeVar("_Key")

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LinkLoad:
    """A live prefill link as `DecodeControl.choose_link` sees it when a request is opened on one."""

    link: LinkEnd
    queued_tokens: int  # prompt tokens of its requests not prefilled yet (or being prefilled again)
    requests: int  # its requests, prefilling or decoding


class DecodeControl(DecodePath):
    """The links to the prefill nodes (`attach()`), what a lost one takes with it, and the requests a step failed
    or parked (stall_timeout, recompute); `DecodeEngine` adds a request's life on top."""

    def __init__(
        self,
        layout: KVLayout,
        num_slots: int,
        max_tokens: int,
        *,
        device: str = "cpu",
        fetch_timeout: float = 30.0,
        recompute: bool = False,
        stall_timeout: float | None = None,
        step_share: bool = True,
        prefill_timeout: float = 120.0,
        prefix_cache: PrefixCache | None = None,
        staged: bool = False,
        quantized: bool = True,
    ) -> None:
        """`stall_timeout`: a step waits this long for one request's fetch, then goes on without it (its rows are
        padding and its step is redone once the fetch lands: see `deferred`); None waits up to `fetch_timeout`.
        `step_share`: in a batch, a member whose fetches have held a step for its share of it is deferred the same
        way, but stays in the batch and redoes the step in the next (`DecodePath.step_share`).
        `prefill_timeout`: a request opened again after decoding began (recompute) waits for the new prefill node
        while its KV (or that of the requests ahead of it there) keeps arriving, and fails once nothing has for
        this long (`stall`). `prefix_cache`: finished requests' prompt KV by token blocks; a new request whose prompt
        starts with cached blocks gets them in its slot at once (local), and its prefill node never sends them.
        `staged`: the pool's lanes land in host memory, copied to the device before a mask is read (pool.py).
        `quantized`: the pool has a staging region for `quant2` requests (False: that scheme is refused)."""
        super().__init__(
            layout,
            num_slots,
            max_tokens,
            device=device,
            staged=staged,
            quantized=quantized,
            prefix_cache=prefix_cache,
            fetch_timeout=fetch_timeout,
            stall_timeout=stall_timeout,
            step_share=step_share,
        )
        self.recompute = recompute  # a prefill node lost: prefill its unfinished requests again elsewhere
        self.prefill_timeout = prefill_timeout
        self.on_link_lost: Callable[[LinkEnd, str], None] | None = None  # told after a link is dropped
        # told (request id, token, arrival) on the link's thread as a first token arrives, so it can be streamed at
        # once, whatever a running batch step is waiting for
        self.on_first_token: Callable[[str, int, float], None] | None = None
        # the same for a second token a FORECAST brings (Policy.second_token): the listener streams it only to a
        # request that will take it (a greedy one); the driver emits it in any case
        self.on_second_token: Callable[[str, int, float], None] | None = None
        # chooses the prefill link a request opens on, from the live links' loads and its prompt ids (roles/placement);
        # None: the one with the fewest requests
        self.choose_link: Callable[[list[LinkLoad], torch.Tensor | None], LinkEnd] | None = None
        self._links: list[LinkEnd] = []
        self._dispatch_order = itertools.count()  # requests opened (or opened again) earlier queue ahead on a link
        self._threads: list[threading.Thread] = []
        self._closing = False

    # -- connections ------------------------------------------------------------------
    def attach(self, link: LinkEnd) -> None:
        """Connects a prefill node: registers the pool's regions on its push lane and listens."""
        for name, buffer in self.pool.byte_views().items():
            link.push.register_region(name, buffer)
        self._links.append(link)
        thread = threading.Thread(target=self._listen, args=(link,), name="decode-listen", daemon=True)
        thread.start()
        self._threads.append(thread)

    @property
    def links(self) -> list[LinkEnd]:
        """The live links (a lost one leaves this list at once)."""
        with self._lock:
            return list(self._links)

    def _listen(self, link: LinkEnd) -> None:
        while True:
            message = link.control.recv(timeout=0.25)
            if message is None:
                if link.alive:
                    continue
                link.close()  # one lane broke (its lease, a bad frame): the link goes as a whole
                self._fail_link(link, link.error or "connection closed")
                return
            try:
                self._handle(msg.unpack(message))
            except msg.MessageError as exc:  # a malformed message fails its request, not the listener
                log.warning("decode: %s for %s refused: %s", message.kind.name, message.request_id, exc)
                self._fail_request(message.request_id, f"bad {message.kind.name} from the prefill node: {exc}")

    def _handle(self, message: msg.EngineMessage) -> None:
        match message:
            case msg.FetchReply() | msg.AttendReply():  # one id space: a step's fetches and attends
                self._note_arrival(message.request_id)
                with self._lock:
                    waiting = self._fetches.pop(message.fetch_id, None)
                if waiting is not None and not waiting[0].done():
                    waiting[0].set_result(message)
            case msg.Metadata():
                request = self._note_arrival(message.request_id)
                if request is not None and 0 <= message.layer < self.layout.num_layers:
                    request.metadata[message.layer] = self._here(message.tensors)
            case msg.FirstToken():
                request = self._note_arrival(message.request_id)
                if request is not None and request.resuming:  # prefilled again elsewhere: metadata is kept
                    assert request.resume is not None
                    if request.first_token.result() != message.token:
                        log.warning("decode: %s prefilled again gives another first token", message.request_id)
                    request.resume.set_result(message.token)
                elif request is not None and not request.first_token.done():
                    for layer, entry in enumerate(msg.unpack_metadata(message.metadata, self.layout.num_layers)):
                        request.metadata[layer].update(self._here(entry))
                    request.metrics.prefill_cached_tokens = message.cached
                    request.forecast_promised = message.forecast
                    request.first_token_at = time.monotonic()
                    request.first_token.set_result(message.token)
                    self._tell_token(self.on_first_token, message.request_id, message.token, request.first_token_at)
            case msg.Forecast():
                request = self._note_arrival(message.request_id)
                if request is None or not request.forecast_promised or request.forecast_taken:
                    pass
                elif message.step == 2:
                    request.head_done = True
                    if request.forecast_next_promised:
                        request.forecast_next = self._here(message.queries)
                elif message.step == 3:  # a head-start token: before the step-2 FORECAST that ends them
                    head = message.second
                    if head is not None and request.forecast_next_promised and not request.head_done:
                        expected = (self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim)
                        if tuple(head.keys.shape) != expected:
                            raise msg.MessageError(f"FORECAST: a head-start token's K/V are {tuple(head.keys.shape)}")
                        device = self.pool.k.device
                        at = time.monotonic()
                        request.head.append(
                            (msg.SecondToken(head.token, head.keys.to(device), head.values.to(device)), at)
                        )
                        self._tell_token(self.on_second_token, message.request_id, head.token, at)
                else:
                    second = message.second
                    if second is not None:
                        device = self.pool.k.device
                        second = msg.SecondToken(second.token, second.keys.to(device), second.values.to(device))
                    expected = (self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim)
                    if second is not None and tuple(second.keys.shape) != expected:
                        log.warning(
                            "decode: the second token of %s comes with K/V %s, not %s: decoded here instead",
                            message.request_id,
                            tuple(second.keys.shape),
                            expected,
                        )
                    elif second is not None and request.second is None and request.metrics.error is None:
                        request.second_at = time.monotonic()
                        request.second = second
                        request.forecast_next_promised = True
                        self._tell_token(self.on_second_token, message.request_id, second.token, request.second_at)
                    # last: the driver takes the second token as soon as it sees the forecast (forecast_pending)
                    request.forecast = self._here(message.queries)
            case msg.Error() | msg.Abort():
                overloaded = isinstance(message, msg.Error) and message.overloaded
                self._fail_request(message.request_id, message.reason or "prefill node failed", overloaded=overloaded)
            case _:
                raise msg.MessageError(f"a decode node does not take {type(message).__name__.upper()} messages")

    def _here(self, tensors: dict[_Key, torch.Tensor]) -> dict[_Key, torch.Tensor]:
        """A message's tensors on the pool's device: a lane decodes them into host memory, and a decode node on a GPU
        selects with them beside the pool's K/V and metadata there (a no-op on the CPU)."""
        return {key: tensor.to(self.pool.k.device) for key, tensor in tensors.items()}

    def _note_arrival(self, request_id: str) -> DecodeRequest | None:
        """A message with KV, metadata or a token arrived for the request: progress (`stall`)."""
        request = self._requests.get(request_id)
        if request is not None:
            request.arrival.note(time.monotonic())
        return request

    @staticmethod
    def _tell_token(listener: Callable[[str, int, float], None] | None, request_id: str, token: int, at: float) -> None:
        if listener is None:
            return
        try:
            listener(request_id, token, at)
        except Exception:  # a listener's bug must not stop this link's thread: the driver streams the token anyway
            log.exception("decode: the token listener failed for %s", request_id)

    def _fail_link(self, link: LinkEnd, reason: str = "connection closed") -> None:
        """The prefill node is gone: drop the link, fail (or re-open) what needed it, wake its fetch waiters."""
        with self._lock:
            if link not in self._links:
                return  # already handled (the listener and `open` may both notice)
            self._links.remove(link)
            victims = [r for r in self._requests.values() if r.link is link and not self._fully_local(r)]
            for request in victims:  # claimed here, under the lock: `open` then leaves them to this thread
                request.orphaned_from = link
            pending = [(i, f) for i, (f, owner) in self._fetches.items() if owner is link]
            for fetch_id, _ in pending:
                self._fetches.pop(fetch_id, None)
        error = f"prefill node connection lost: {reason}"
        log.log(
            logging.INFO if self._closing else logging.WARNING,
            "decode: %s; %d request(s) needed it",
            error,
            len(victims),
        )
        for request in victims:
            if not (self.recompute and self._reopen(request)):
                self._fail_request(request.request_id, error, lost=True)
        for _fetch_id, future in pending:
            if not future.done():
                self.counters.add_failure("on_demand")
                future.set_exception(LinkLost(error))
        if self.on_link_lost is not None:
            self.on_link_lost(link, reason)

    def _claim_orphan(self, request: DecodeRequest, link: LinkEnd) -> bool:
        """Whether this thread handles `request` for the loss of `link`: True once per loss, to whichever thread asks
        first (`_fail_link` claims its victims as it drops the link), so a request is never opened again twice."""
        with self._lock:
            if request.link is not link or request.orphaned_from is link:
                return False
            request.orphaned_from = link
            return True

    def _fully_local(self, request: DecodeRequest) -> bool:
        """Every prompt token is in the pool: it decodes on without its prefill node. A quantized transfer's
        layers that arrived are dequantized into the pool first."""
        if request.flags.quantized:
            self.pool.land_quantized(request.slot, request.length)
        self.pool.sync_staged(None, [request.slot])
        return self.pool.masks.all_local(request.slot, request.length)

    def _reopen(self, request: DecodeRequest) -> bool:
        """Opens a request again on another live prefill node; False when none is left.

        The OPEN says which prompt tokens are local already (never pushed again). A request past its first
        token is `resuming` until the new node's FIRST_TOKEN: it steps no more (the driver parks it), and
        what it fetched from the lost node and never got is asked of the new one when it steps again.
        """
        try:
            link = self._pick_link(request.open_message.prompt_ids if request.open_message is not None else None)
        except RequestFailed:
            return False
        assert request.open_message is not None
        held = (self.pool.masks.values[:, request.slot, : request.length] == LOCAL).all(dim=-1)  # [L, n]: all heads
        decoding = request.first_token.done()
        if decoding:
            request.resume = Future()
            # a resumed prefill forecasts nothing: a FORECAST the lost node promised and never sent will not come
            request.forecast_promised = request.forecast_promised and request.forecast is not None
            request.forecast_next_promised = request.forecast_next_promised and request.forecast_next is not None
        request.late = []  # their futures failed with the lost link
        request.link = link
        request.arrival.redispatch(next(self._dispatch_order), time.monotonic())
        message = replace(request.open_message, held=held if bool(held.any()) else None, resumed=decoding)
        link.push.accept(request.request_id, self.pool.geometry.slot_extents(request.slot, request.length))
        link.control.send(message.pack())
        log.info(
            "decode: request %s opened again on another prefill node (%d of %d prompt KV entries kept)",
            request.request_id,
            int(held.sum()),
            held.numel(),
        )
        return True

    def _fail_request(self, request_id: str, reason: str, *, overloaded: bool = False, lost: bool = False) -> None:
        request = self._requests.get(request_id)
        if request is None:
            return
        if not request.metrics.error:
            request.metrics.error = reason
            request.overloaded, request.lost = overloaded, lost
        if not request.first_token.done():
            request.first_token.set_exception(RequestFailed(reason))
        if request.resuming:
            assert request.resume is not None
            request.resume.set_exception(RequestFailed(reason))

    def _pick_link(self, prompt_ids: torch.Tensor | None = None) -> LinkEnd:
        with self._lock:
            live = [link for link in self._links if link.alive]
            if not live:
                raise LinkLost("no live prefill node: every link is down (see /health)")
            load = {id(link): [0, 0] for link in live}  # queued prompt tokens, requests
            for request in self._requests.values():
                if id(request.link) in load:
                    load[id(request.link)][1] += 1
                    if not request.first_token.done() or request.resuming:
                        load[id(request.link)][0] += request.length
            loads = [LinkLoad(link, *load[id(link)]) for link in live]
        if self.choose_link is not None:  # outside the lock: it may keep state of its own
            return self.choose_link(loads, prompt_ids)
        return min(loads, key=lambda entry: entry.requests).link

    # -- stalled requests (stall_timeout) ---------------------------------------------------
    def deferred(self, request_ids: list[str]) -> list[int]:
        """Indices (into `request_ids`) of requests whose step this time waited too long for a fetch."""
        return [i for i, rid in enumerate(request_ids) if rid in self._requests and self._requests[rid].deferred]

    def undo_step(self, request_id: str) -> None:
        """Takes back a deferred request's step: the token it appended goes, the step will be done again."""
        request = self._require_any(request_id)
        self.pool.drop_last(request.slot)
        request.step_selections = []  # the layers it got through are selected again when the step is redone
        request.deferred = request.held_back = False
        request.step_wait_s = 0.0

    def held_back(self, request_id: str) -> bool:
        """Whether a deferred request was deferred for holding the batch past its share of the step (it stays in
        the batch and redoes the step in the next), not for a stalled fetch (it parks until the fetch lands)."""
        return self._require_any(request_id).held_back

    def ready_to_resume(self, request_id: str) -> bool:
        """A deferred request may step again: its late fetches have landed (and, opened again after its prefill
        node was lost, the new node has prefilled it), or it failed (past fetch_timeout, or nothing arrived for it
        for prefill_timeout while it waited to be prefilled again)."""
        request = self._require_any(request_id)
        if request.metrics.error:
            return True
        if request.resuming:
            stall = self.stall(request_id, self.prefill_timeout)
            if stall is not None:
                self._fail_request(request_id, f"not prefilled again: {stall.describe(self.prefill_timeout)}")
                return True
            return False
        if not request.link.alive:
            return False  # its link is being dropped: it is opened again elsewhere or fails
        self._land_late([request])
        if request.late and request.deferred_since is not None:
            if time.monotonic() - request.deferred_since > self.fetch_timeout:
                self.counters.add_failure("on_demand")
                self._fail_request(request_id, f"fetch timed out after {self.fetch_timeout:g} s")
        return not request.late or bool(request.metrics.error)

    # -- progress (the first-token bound) ----------------------------------------------------
    def stall(self, request_id: str, bound: float, now: float | None = None) -> Stall | None:
        """Whether nothing has arrived for the request for over `bound` seconds: no KV landed for it and no message
        came, nor for any request dispatched before it on its link (its transfer queues behind theirs: a prefill
        node prefills in turn, a link moves its pushes in order). None while something arrives, however slowly.

        No hard ceiling is kept beside it: one would fail exactly the long queued transfers this bound lets through,
        and waiting behind others is bounded anyway: the requests ahead are fixed at its dispatch (no later one
        joins them), and each of them ends (its tokens are finite, its own waits bounded). `now`: the clock's
        reading (default time.monotonic())."""
        request = self._require_any(request_id)
        now = time.monotonic() if now is None else now
        if not request.arrival.judge_due(now, bound):
            return None
        link, order = request.link, request.arrival.order
        with self._lock:
            ahead = [r for r in self._requests.values() if r.link is link and r.arrival.order < order]
        return judge(self.pool, request, ahead, bound, now)

    def _hand_on_progress(self, leaving: DecodeRequest) -> None:
        """A request leaves: its last arrival still counts for the requests queued behind it on its link. Called
        before its slot is freed: one last count catches what landed since they last looked (a request whose KV
        completes and that finishes between two looks would hand on an older arrival)."""
        link, order = leaving.link, leaving.arrival.order
        with self._lock:
            behind = [r for r in self._requests.values() if r.link is link and r.arrival.order > order]
        if not behind:
            return
        progress = leaving.arrival
        if not progress.complete:
            landed = landed_entries(self.pool, leaving.slot, leaving.length, leaving.flags.quantized)
            progress.count(landed, time.monotonic(), since=min(r.arrival.dispatched_at for r in behind))
        for request in behind:
            request.arrival.ahead_left(progress.last_at)
