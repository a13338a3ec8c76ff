"""The decode side of the transfer engine: KV pool, masks, and the parallel local/remote fetch.

A request on the decode node:
1. `open()`: a pool slot is taken (its masks say remote, padding 0), the push lane accepts
   writes for it, a prefill node is chosen (least loaded) and OPEN is sent.
2. Prefilling: proactive blocks land and their mask entries turn 1; `wait_first_token()`
   returns FIRST_TOKEN. Under full transfer `wait_all_local()` blocks until every block landed.
3. Decoding, per step and layer: `begin_layer()` sends the idle notice (speculative
   policies); `assemble()` splits the selector's index by the mask, gathers local entries
   while the remote ones are fetched, lands fetched tokens in the pool (mask 1, so they are
   never fetched twice) and returns the selected KV (a drop_remote policy, proactive-only,
   fetches nothing: remote entries count as padding); `append()` adds the new token's K/V.
4. Fully local: `end_step()` sends RELEASE once every block is local.
5. `finish()` / `abort()`: the lane stops accepting writes for the request, its slot is
   freed, and RELEASE / ABORT goes to the prefill node if it was not sent yet.
A prefill node lost (its link closed: dead, silent past its lease, or misbehaving): the link
leaves the list at once, so no new request picks it; requests that still needed it fail with
the reason (or, with `recompute`, they are opened again on another prefill node, telling it which
tokens are already local: a request that was decoding waits outside the batch, parked, until the new
node has prefilled, then fetches what it lacks); requests already fully local go on. Inside a decode step a failed request is only
marked, never raised, so the step completes for the rest of the batch (see DecodeDriver).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from smartgen.engine import messages as msg
from smartgen.engine.index_ops import IndexSplit, entry_status, gather_kv, split_reorder
from smartgen.engine.layout import DENSE_LAYERS, KVLayout
from smartgen.engine.mask import LOCAL, REMOTE
from smartgen.engine.metrics import PathCounters, RequestMetrics, RequestState
from smartgen.engine.policy import Policy
from smartgen.engine.pool import DecodePool
from smartgen.engine.prefix_cache import PrefixCache
from smartgen.lanes.base import Landing
from smartgen.lanes.link import LinkEnd

__all__ = ["DecodeEngine", "Assembled", "RequestFailed", "LinkLost"]

log = logging.getLogger(__name__)

# a policy that chains its speculative slices sends an idle notice (with the hints gathered since the last) at the
# start of every this many layers, not of every layer: the chain, not the notices, keeps its link busy
CHAINED_NOTICE_LAYERS = 4


class RequestFailed(RuntimeError):
    """A request could not go on: its prefill node failed it, went away, or timed out."""


class LinkLost(RequestFailed):
    """A fetch's prefill node went away (with `recompute` its request is opened again, not failed), or none is live."""


class Assembled(NamedTuple):
    """The selected KV of one layer for a batch: rows remote-first, padding last."""

    k: torch.Tensor  # [R, k, d]
    v: torch.Tensor  # [R, k, d]
    num_valid: torch.Tensor  # [R] int32: entries [0, num_valid) of each row are real
    split: IndexSplit


def _drop_remote_rows(split: IndexSplit, rows: torch.Tensor) -> IndexSplit:
    """Proactive-only rows (`rows` [R] bool): remote entries turn into padding (rows local-first), so they
    are never fetched or attended; the other rows are left as they are."""
    dropped = rows.unsqueeze(1) & (split.status == REMOTE)
    status = torch.where(dropped, torch.zeros_like(split.status), split.status)
    order = torch.sort(status.to(torch.int16), dim=1, descending=True, stable=True).indices
    keep = ~rows.unsqueeze(1)
    return IndexSplit(
        torch.where(keep, split.index, torch.gather(split.index, 1, order)),
        torch.where(keep, split.status, torch.gather(status, 1, order)),
        torch.where(rows, torch.zeros_like(split.num_remote), split.num_remote),
        split.num_local,
    )


def _fetch_message(request_id: str, layer: int, fetch_id: int, entries: torch.Tensor, num_heads: int) -> msg.Fetch:
    """FETCH for flat (token, head) ids token * H + head, sorted: positions and the [T, H] heads wanted."""
    positions, token_of = torch.unique_consecutive(entries // num_heads, return_inverse=True)
    heads = torch.zeros(positions.numel(), num_heads, dtype=torch.bool)
    heads[token_of, entries % num_heads] = True
    return msg.Fetch(request_id, layer, fetch_id, positions, heads)


@dataclass(slots=True)
class _Request:
    request_id: str
    slot: int
    length: int
    link: LinkEnd
    policy: Policy
    metrics: RequestMetrics
    fetch_counts: torch.Tensor  # [L, n, H] int32: how often each (token, KV head) entry was fetched
    first_token: Future = field(default_factory=Future)
    metadata: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per layer, from METADATA messages
    released: bool = False
    open_message: msg.Open | None = None  # kept to open the request again elsewhere (recompute)
    # fetches a step gave up waiting for (stall_timeout): (layer, positions, future, sent); landed when they arrive
    late: list[tuple[int, torch.Tensor, Future, float]] = field(default_factory=list)
    deferred: bool = False  # this step waited too long for a fetch: its rows are padding, its step is redone
    hints: list[torch.Tensor] = field(default_factory=list)  # flat ids (layer * length + token) for the next IDLE
    deferred_since: float | None = None  # when the fetch it is waiting for was sent (fetch_timeout counts from it)
    # opened again after decoding began (recompute): the new node's FIRST_TOKEN says it has prefilled
    resume: Future | None = None
    resumed_at: float = 0.0
    overloaded: bool = False  # its prefill node refused it for lack of room (a 503 for the client, not a fault)
    lost: bool = False  # it failed because its prefill node was lost, and no other took it (a 503, not a fault)
    # per layer, whether any prompt entry was remote when this step first asked (None: not asked yet this step)
    remote_layers: list[bool] | None = None
    layers_since_notice: int = 0  # layers begun since its last idle notice (0: none sent yet)
    # layers whose selection (or prefetch) met remote entries this step, and last step's (None: no step yet)
    remote_met: set[int] = field(default_factory=set)
    remote_met_before: set[int] | None = None

    @property
    def resuming(self) -> bool:
        """Waiting for another prefill node to prefill it again: it must not step (nothing to fetch from yet)."""
        return self.resume is not None and not self.resume.done()


class DecodeEngine:
    """Owns the decode pool and talks to the prefill nodes attached with `attach()`."""

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
        prefill_timeout: float = 120.0,
        prefix_cache: PrefixCache | None = None,
        staged: bool = False,
        quantized: bool = True,
    ) -> None:
        """`stall_timeout`: a step waits this long for one request's fetch, then goes on without it (its rows are
        padding and its step is redone once the fetch lands: see `deferred`); None waits up to `fetch_timeout`.
        `prefill_timeout`: a request opened again after decoding began (recompute) waits this long for the new
        prefill node. `prefix_cache`: finished requests' prompt KV by token blocks; a new request whose prompt
        starts with cached blocks gets them in its slot at once (local), and its prefill node never sends them.
        `staged`: the pool's lanes land in host memory, copied to the device before a mask is read (pool.py).
        `quantized`: the pool has a staging region for `quant2` requests (False: that scheme is refused)."""
        self.layout = layout
        self.prefix_cache = prefix_cache or PrefixCache(0)
        self.held_bytes = 0  # KV bytes the prefix cache supplied instead of the link
        self.pool = DecodePool(layout, num_slots, max_tokens, device=device, staged=staged, quantized=quantized)
        self.counters = PathCounters()
        self.fetch_timeout = fetch_timeout  # seconds one step waits for a fetch before failing that request
        self.recompute = recompute  # a prefill node lost: prefill its unfinished requests again elsewhere
        self.stall_timeout = stall_timeout
        self.prefill_timeout = prefill_timeout
        self.on_link_lost: Callable[[LinkEnd, str], None] | None = None  # told after a link is dropped
        self._links: list[LinkEnd] = []
        self._requests: dict[str, _Request] = {}
        self._fetches: dict[int, tuple[Future, LinkEnd]] = {}
        self._fetch_ids = itertools.count()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closing = False
        regions = self.pool.byte_views()
        self._reply_regions = (regions["k"], regions["v"])  # where a lane that can lands fetch replies in place

    # -- connections ------------------------------------------------------------------
    def attach(self, link: LinkEnd) -> None:
        """Connects a prefill node: registers the pool's regions on its push lane and listens."""
        for name, buffer in self.pool.byte_views().items():
            link.push.register_region(name, buffer)
        self._links.append(link)
        thread = threading.Thread(target=self._listen, args=(link,), name="decode-listen", daemon=True)
        thread.start()
        self._threads.append(thread)

    def close(self) -> None:
        self._closing = True
        for request_id in list(self._requests):
            self.abort(request_id, "decode engine closed")
        for link in self.links:  # a copy: each link's listener drops it from self._links as it sees it close
            link.close()
        for thread in self._threads:
            thread.join(timeout=5)

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
            case msg.FetchReply():
                with self._lock:
                    waiting = self._fetches.pop(message.fetch_id, None)
                if waiting is not None and not waiting[0].done():
                    waiting[0].set_result(message)
            case msg.Metadata():
                request = self._requests.get(message.request_id)
                if request is not None and 0 <= message.layer < self.layout.num_layers:
                    request.metadata[message.layer] = message.tensors
            case msg.FirstToken():
                request = self._requests.get(message.request_id)
                if request is not None and request.resuming:  # prefilled again elsewhere: metadata is kept
                    assert request.resume is not None
                    if request.first_token.result() != message.token:
                        log.warning("decode: %s prefilled again gives another first token", message.request_id)
                    request.resume.set_result(message.token)
                elif request is not None and not request.first_token.done():
                    for layer, entry in enumerate(msg.unpack_metadata(message.metadata, self.layout.num_layers)):
                        request.metadata[layer].update(entry)
                    request.metrics.prefill_cached_tokens = message.cached
                    request.first_token.set_result(message.token)
            case msg.Error() | msg.Abort():
                overloaded = isinstance(message, msg.Error) and message.overloaded
                self._fail_request(message.request_id, message.reason or "prefill node failed", overloaded=overloaded)
            case _:
                raise msg.MessageError(f"a decode node does not take {type(message).__name__.upper()} messages")

    def _fail_link(self, link: LinkEnd, reason: str = "connection closed") -> None:
        """The prefill node is gone: drop the link, fail (or re-open) what needed it, wake its fetch waiters."""
        with self._lock:
            if link not in self._links:
                return  # already handled (the listener and `open` may both notice)
            self._links.remove(link)
            victims = [r for r in self._requests.values() if r.link is link and not self._fully_local(r)]
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

    def _fully_local(self, request: _Request) -> bool:
        """Every prompt token is in the pool: it decodes on without its prefill node. A quantized transfer's
        layers that arrived are dequantized into the pool first."""
        if request.policy.quantize_bits:
            self.pool.land_quantized(request.slot, request.length)
        self.pool.sync_staged(None, [request.slot])
        return self.pool.masks.all_local(request.slot, request.length)

    def _reopen(self, request: _Request) -> bool:
        """Opens a request again on another live prefill node; False when none is left.

        The OPEN says which prompt tokens are local already (never pushed again). A request past its first
        token is `resuming` until the new node's FIRST_TOKEN: it steps no more (the driver parks it), and
        what it fetched from the lost node and never got is asked of the new one when it steps again.
        """
        try:
            link = self._pick_link()
        except RequestFailed:
            return False
        assert request.open_message is not None
        held = (self.pool.masks.values[:, request.slot, : request.length] == LOCAL).all(dim=-1)  # [L, n]: all heads
        decoding = request.first_token.done()
        if decoding:
            request.resume, request.resumed_at = Future(), time.monotonic()
        request.late = []  # their futures failed with the lost link
        request.link = link
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

    def _pick_link(self) -> LinkEnd:
        with self._lock:
            live = [link for link in self._links if link.alive]
            if not live:
                raise LinkLost("no live prefill node: every link is down (see /health)")
            load = {id(link): 0 for link in live}
            for request in self._requests.values():
                if id(request.link) in load:
                    load[id(request.link)] += 1
            return min(live, key=lambda link: load[id(link)])

    # -- request life -----------------------------------------------------------------
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
    ) -> str:
        """Admits a request of `length` prompt tokens: slot, masks, lane, OPEN. Returns its id.

        `prompt_ids` travel with OPEN when the prefill node runs a model (serving). `arrival`
        (time.monotonic(), default now) is when the request arrived: its TTFT and TTST count from it.
        `oracle_counts` ([L, n]): a recorded run's selection counts, for the "optimal" proactive set.
        """
        request_id = request_id or uuid.uuid4().hex
        link = self._pick_link()  # before the slot: with no live prefill node the request fails at once
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
        )
        request = _Request(
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
            if request.link is link and not request.metrics.error and not (self.recompute and self._reopen(request)):
                self._fail_request(
                    request_id, f"prefill node connection lost: {reason}", lost=True
                )  # the link was dropped just before
        return request_id

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

    def _cache_prompt(self, request: _Request) -> None:
        """A finished request's prompt blocks that are local in every layer go to the prefix cache (only the
        prompt: generated tokens' K/V come from sparse decode steps, not from prefill)."""
        prompt = request.open_message.prompt_ids if request.open_message is not None else None
        if prompt is None or not self.prefix_cache.enabled or request.policy.quantize_bits:
            return
        local = self.pool.masks.local_prefix(request.slot, request.length)
        local -= local % self.prefix_cache.block_tokens
        if local:
            k, v = self.pool.k[:, request.slot, :local], self.pool.v[:, request.slot, :local]
            self.prefix_cache.insert(prompt[:local], k, v)

    def wait_first_token(self, request_id: str, timeout: float | None = None) -> int:
        request = self._require(request_id)
        try:
            token = request.first_token.result(timeout=timeout)
        except TimeoutError:
            raise RequestFailed(f"no first token for {request_id} within {timeout} s") from None
        request.metrics.record_token(time.monotonic())
        request.metrics.state = RequestState.DECODING
        return token

    def first_token_ready(self, request_id: str) -> bool:
        """Non-blocking: has FIRST_TOKEN (or a failure) arrived?"""
        return self._require_any(request_id).first_token.done()

    def request_metadata(self, request_id: str) -> list[dict[str, torch.Tensor]]:
        return self._require(request_id).metadata

    def dense_layers_local(self, request_id: str) -> bool:
        """Layers 0-1 of the request (pushed whole during its prefill) are all in the pool, or it failed: a request
        joining a running batch waits for them outside it (a step would wait for them, and the batch with it)."""
        request = self._require_any(request_id)
        if request.metrics.error or request.policy.drop_remote:
            return True
        self.pool.sync_staged(None, [request.slot])
        dense = self.pool.masks.values[:DENSE_LAYERS, request.slot, : request.length]
        return bool((dense == LOCAL).all())

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

    def _require_any(self, request_id: str) -> _Request:
        request = self._requests.get(request_id)
        if request is None:
            raise KeyError(f"unknown request {request_id!r}")
        return request

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

    def begin_layer(self, layer: int, request_ids: list[str]) -> None:
        """The start of an attention layer: tell prefill nodes the link is idle (speculative policies), with the
        hints gathered since the last notice. Not in a request's first decode step: its fetches (what TTST
        waits for) would share the link with speculative pushes (measured: +30 ms of wait on the 16-layer
        sample); speculation starts with the second step. A policy that chains its slices keeps the link busy
        without notices, so it sends one every CHAINED_NOTICE_LAYERS layers (the first at once): each notice is a
        message the step thread hands to the lane's sender (py-spy: 5 ms a step at one per layer on 32 layers)."""
        for request_id in request_ids:
            request = self._require_any(request_id)
            if request.policy.speculative and not (request.released or request.metrics.error or request.resuming):
                if request.metrics.in_first_step:  # every byte on the link now is one the first step waits for
                    continue
                if any(not future.done() for _, _, future, _ in request.late):  # a fetch is on the link: not idle
                    continue
                if request.policy.chain and 0 < request.layers_since_notice < CHAINED_NOTICE_LAYERS:
                    request.layers_since_notice += 1
                    continue  # its hints wait for the next notice
                request.layers_since_notice = 1
                hints = torch.cat(request.hints).unique() if request.hints else None
                request.hints = []
                request.link.control.send(msg.Idle(request_id, layer, hints).pack())

    def hint_factor(self, request_ids: list[str], layer: int | None = None) -> float:
        """The widest hint ratio among these requests' policies (0: none hints). A request whose KV is all local
        hints nothing: the wider ranking and its mask lookups would cost step time for nothing; with `layer`, nor
        does one whose KV of that layer is all local (there is nothing left to push ahead there)."""
        return max(
            (
                r.policy.hints
                for r in map(self._require_any, request_ids)
                if r.policy.hints and not r.released and (layer is None or self._has_remote(r, layer))
            ),
            default=0.0,
        )

    def _has_remote(self, request: _Request, layer: int) -> bool:
        """Whether any (token, head) entry of the request's prompt in `layer` is still remote. Asked two or three
        times for every layer of every step (hints, prefetch), so every layer is scanned in one pass at the
        step's first ask and the answer kept for the step (`end_step` drops it). A kept answer can only be stale
        the safe way: nothing turns a LOCAL entry back to REMOTE while the request holds its slot, so a layer that
        lands meanwhile costs at most a selector pass that fetches nothing. One scan per layer and ask cost ~40 us
        (2.5 ms a step on 32 layers in a py-spy profile); the pass over all layers costs about one of them."""
        if request.remote_layers is None:
            masks = self.pool.masks.values[:, request.slot, : request.length]  # [L, n, H]
            request.remote_layers = (masks == REMOTE).flatten(1).any(dim=1).tolist()
        return request.remote_layers[layer]

    def hint(self, layer: int, request_ids: list[str], wide: torch.Tensor) -> None:
        """Notes, for the next IDLE, the prompt tokens of one layer that a wider selection (`wide` [B·H, k'], the
        selector at (1 + hints) x its budget) picks and that are still remote in some head: what the selector is
        likely to pick next. Only requests whose policy hints."""
        num_heads = self.layout.num_kv_heads
        requests = [self._require_any(rid) for rid in request_ids]
        slots = torch.tensor([r.slot for r in requests], dtype=torch.int64, device=wide.device)
        status = entry_status(wide, self.pool.masks.layer(layer).to(wide.device), slots, num_heads)
        for b, request in enumerate(requests):
            if not request.policy.hints or request.released or request.metrics.error or request.resuming:
                continue
            rows = slice(b * num_heads, (b + 1) * num_heads)
            remote = status[rows] == REMOTE
            if bool(remote.any()):
                request.hints.append(wide[rows][remote].unique().cpu() + layer * request.length)

    def assemble(
        self, layer: int, request_ids: list[str], index: torch.Tensor, timeout: float | None = None
    ) -> Assembled:
        """Gathers the selected KV of one layer: index [B·H, k] -> K, V [B·H, k, d], remote-first rows.

        Every policy decision is the request's own, never the batch's: a drop-remote request's
        remote entries turn into padding while its neighbours' are fetched, and a parallel
        request gathers its local entries while the fetches are in flight, a sequential one after.
        A fetch that fails or outlasts `timeout` (default: the engine's fetch_timeout) fails its own
        request only (marked, not raised): the layer is assembled for the rest of the batch.
        """
        requests = [self._require_any(rid) for rid in request_ids]
        self._land_late(requests)
        self.pool.sync_staged(layer, [r.slot for r in requests])
        if layer < DENSE_LAYERS:
            self._await_pushed(layer, requests, self.fetch_timeout if timeout is None else timeout)
        num_heads = self.layout.num_kv_heads
        slots = torch.tensor([r.slot for r in requests], dtype=torch.int64, device=index.device)
        split = split_reorder(index, self.pool.masks.layer(layer).to(index.device), slots, num_heads)
        drop_rows = self._rows_where(requests, index.device, lambda policy: policy.drop_remote)
        # a request this step already gave up on fetches nothing more: its step is redone anyway
        drop_rows |= torch.tensor([r.deferred for r in requests], device=index.device).repeat_interleave(num_heads)
        dropped = torch.zeros_like(split.num_remote)
        if bool(drop_rows.any()):
            dropped = torch.where(drop_rows, split.num_remote, dropped)  # selected, never attended: not covered
            split = _drop_remote_rows(split, drop_rows)
        num_rows, k = index.shape
        k_out = torch.zeros(num_rows, k, self.layout.head_dim, dtype=self.layout.dtype, device=self.pool.k.device)
        v_out = torch.zeros_like(k_out)
        num_remote, num_local = split.num_remote, split.num_local
        fetches = self._send_fetches(layer, requests, split)
        local_start = num_remote
        local_stop = num_remote + num_local
        parallel_rows = self._rows_where(requests, index.device, lambda policy: policy.parallel)
        # local entries of parallel requests now, while their fetches are in flight; the others' after landing
        early_stop = torch.where(parallel_rows, local_stop, local_start)
        started = time.monotonic()
        gather_kv(self.pool.k[layer], self.pool.v[layer], slots, split.index, local_start, early_stop, k_out, v_out)
        entry_bytes = 2 * k_out.shape[-1] * k_out.element_size()  # K and V of one token in one head
        self.counters.add("local", int((early_stop - local_start).sum()) * entry_bytes, time.monotonic() - started)
        self._land_fetches(layer, fetches, self.fetch_timeout if timeout is None else timeout)
        if not bool(parallel_rows.all()):
            local_started = time.monotonic()
            gather_kv(self.pool.k[layer], self.pool.v[layer], slots, split.index, early_stop, local_stop, k_out, v_out)
            late_bytes = int((local_stop - early_stop).sum()) * entry_bytes
            self.counters.add("local", late_bytes, time.monotonic() - local_started)
        if fetches:
            zeros = torch.zeros_like(num_remote)
            gather_kv(self.pool.k[layer], self.pool.v[layer], slots, split.index, zeros, num_remote, k_out, v_out)
        selected = remote = 0
        for b, request in enumerate(requests):
            if request.deferred:
                continue  # its step is redone: counted then
            rows = slice(b * num_heads, (b + 1) * num_heads)
            row_selected, row_remote = int(local_stop[rows].sum()), int(num_remote[rows].sum())
            request.metrics.count_selection(row_selected, row_remote, layer, int(dropped[rows].sum()))
            if row_remote:
                request.remote_met.add(layer)
            if layer >= DENSE_LAYERS:  # layers 0-1 move whole whatever is selected: the bound counts them apart
                new = self._newly_selected(request, layer, split.index[rows])
                request.metrics.count_new_selection(new * entry_bytes)
            selected += row_selected
            remote += row_remote
        self.counters.add_selection(selected, remote)
        return Assembled(k_out, v_out, local_stop, split)

    def _await_pushed(self, layer: int, requests: list[_Request], timeout: float) -> None:
        """Layers 0-1 are pushed whole for every request: while that push is on its way, fetching the layer would
        send its bytes twice (a push's masks turn local only once all its data is in, so every token still looks
        remote). Waits for the push instead, up to `stall_timeout` (else `timeout`); what is still remote after
        that is fetched."""
        limit = min(timeout, self.stall_timeout) if self.stall_timeout is not None else timeout
        deadline = time.monotonic() + limit
        mask = self.pool.masks.values[layer]
        for request in requests:
            waited = time.monotonic()
            while not bool((mask[request.slot, : request.length] == LOCAL).all()):  # every token, every head
                if request.metrics.error or request.deferred or time.monotonic() > deadline:
                    break
                time.sleep(0.0002)
                self.pool.sync_staged(layer, [request.slot])
            request.metrics.count_fetch_wait(time.monotonic() - waited)  # the link's time, as a fetch's would be

    def _newly_selected(self, request: _Request, layer: int, rows: torch.Tensor) -> int:
        """How many entries of index rows [H, k] no earlier step of `request` selected; counts the selection of
        each (`RequestMetrics.selection_counts`)."""
        counts = request.metrics.selection_counts
        if counts is None:
            shape = (self.layout.num_layers, request.length, self.layout.num_kv_heads)
            counts = request.metrics.selection_counts = torch.zeros(shape, dtype=torch.int32)
        heads = torch.arange(rows.shape[0], device=rows.device)[:, None].expand_as(rows)
        valid = (rows >= 0) & (rows < request.length)
        tokens, heads = rows[valid].cpu(), heads[valid].cpu()
        seen = counts[layer]
        new = int((seen[tokens, heads] == 0).sum())
        seen.index_put_((tokens, heads), torch.ones(len(tokens), dtype=torch.int32), accumulate=True)
        return new

    def _rows_where(
        self, requests: list[_Request], device: torch.device, test: Callable[[Policy], bool]
    ) -> torch.Tensor:
        """[B·H] bool: the index rows of the requests whose policy passes `test`."""
        per_request = torch.tensor([test(r.policy) for r in requests], dtype=torch.bool, device=device)
        return per_request.repeat_interleave(self.layout.num_kv_heads)

    def local_spans(
        self, layer: int, request_ids: list[str], starts: list[int], stops: list[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Fast path for dense and sliding-window layers: views of tokens [start_b, stop_b) of each request.

        Returns K and V views ([n_b, H, d], no copy) when every one of those tokens is local,
        else None (use `assemble`, which fetches what is missing).
        """
        requests = [self._require_any(rid) for rid in request_ids]
        self.pool.sync_staged(layer, [r.slot for r in requests])
        mask = self.pool.masks.values[layer]
        for request, start, stop in zip(requests, starts, stops):
            if stop > start and bool((mask[request.slot, start:stop] != LOCAL).any()):
                return None
        spans = []
        heads = self.layout.num_kv_heads
        for request, start, stop in zip(requests, starts, stops):
            spans.append((self.pool.k[layer, request.slot, start:stop], self.pool.v[layer, request.slot, start:stop]))
            request.metrics.count_selection(heads * (stop - start), 0, layer)
        self.counters.add_selection(heads * sum(stop - start for start, stop in zip(starts, stops)), 0)
        return spans

    def _send_fetches(
        self, layer: int, requests: list[_Request], split: IndexSplit
    ) -> list[tuple[_Request, torch.Tensor, Future, float]]:
        """FETCH for every request with remote entries: exactly its remote (token, KV head) entries, as flat ids
        token * H + head (a head no query of the step selected is not moved)."""
        num_heads = self.layout.num_kv_heads
        fetches = []
        for b, request in enumerate(requests):
            rows = slice(b * num_heads, (b + 1) * num_heads)
            status = split.status[rows]
            remote = status == REMOTE
            if not bool(remote.any()) or request.metrics.error:
                continue  # a failed request's rows are assembled from what is local; it leaves after the step
            if request.resuming:  # nothing to fetch from until its new prefill node has prefilled: park it
                request.deferred = True
                continue
            head = torch.arange(num_heads, device=status.device).unsqueeze(1).expand_as(status)
            entries = (split.index[rows][remote] * num_heads + head[remote]).unique().cpu()  # sorted: token-major
            in_flight = [entry for entry in request.late if entry[0] == layer]
            if in_flight:  # a redone step waits for what an earlier try asked for instead of asking again
                request.late = [entry for entry in request.late if entry[0] != layer]
                fetches += [(request, asked, fut, sent) for _, asked, fut, sent in in_flight]
                asked = torch.cat([asked for _, asked, _, _ in in_flight])
                entries = entries[~torch.isin(entries, asked)]
                if not entries.numel():
                    continue
            fetches.append((request, entries, self._send_fetch(request, layer, entries), time.monotonic()))
        return fetches

    def _send_fetch(self, request: _Request, layer: int, entries: torch.Tensor) -> Future:
        """Sends one FETCH for flat (token, head) ids of one layer; its future gets the reply (or LinkLost)."""
        future: Future = Future()
        link = request.link  # once: a lost link may be swapped for another under us (recompute)
        with self._lock:
            fetch_id = next(self._fetch_ids)
            self._fetches[fetch_id] = (future, link)
        if not link.alive:
            future.set_exception(LinkLost(f"prefill node connection lost: {link.error or 'connection closed'}"))
        fetch = _fetch_message(request.request_id, layer, fetch_id, entries, self.layout.num_kv_heads)
        landing = self._landing(request, layer, entries) if link.control.lands_replies else None
        link.control.send(fetch.pack(), tag="fetch_request", landing=landing)
        return future

    def _landing(self, request: _Request, layer: int, entries: torch.Tensor) -> Landing:
        """Where a FETCH's reply belongs: its K rows, then its V rows (the reply's payload order)."""
        ranges = self.pool.geometry.entry_ranges(layer, request.slot, entries)
        k, v = self._reply_regions
        return Landing(request.request_id, [(k, o, n) for o, n in ranges] + [(v, o, n) for o, n in ranges])

    def prefetch_wanted(self, request_ids: list[str], layer: int | None = None) -> bool:
        """Whether any of these requests prefetches now: its policy does, and it is past its first decode step,
        where the link, not compute, is what the step waits for, and a wrong guess's bytes only delay it. With
        `layer` (the one to prefetch), only a request with remote KV left in it: speculating a selection of a
        layer that is all local would cost the step a selector pass for no fetch."""
        return any(
            self._prefetches(request) and (layer is None or self._wants_prefetch(request, layer))
            for request in map(self._require_any, request_ids)
        )

    def _wants_prefetch(self, request: _Request, layer: int) -> bool:
        """Layer `layer` is worth a speculated selection: it still has remote entries, and last step's selection
        (or prefetch) of it met some. Once hints and speculation keep a layer's picks local, a prefetch finds
        nothing to fetch and its selector pass only takes the decode node's CPU from the step: on 32 layers
        (random weights, D = 0.15) ungated prefetch cost 14 ms of CPU a step and TBT 1.10x full's against 1.08x
        without it; gated, 1.08x, while it still runs where fetches do (the early steps, a link-bound model)."""
        if not self._has_remote(request, layer):
            return False
        return request.remote_met_before is None or layer in request.remote_met_before

    @staticmethod
    def _prefetches(request: _Request) -> bool:
        """Its policy prefetches, it is past its first step, and it still has remote KV (not released)."""
        return request.policy.prefetch and not request.metrics.in_first_step and not request.released

    def prefetch(self, layer: int, request_ids: list[str], index: torch.Tensor) -> None:
        """Fetches now the remote entries of a speculated index ([B·H, k], layer l+1's selection guessed while layer
        l computes), for requests whose policy prefetches. They are in flight like a stalled step's fetches
        (`late`): layer l+1's own selection waits for them instead of asking again, and fetches only the rest."""
        num_heads = self.layout.num_kv_heads
        requests = [self._require_any(rid) for rid in request_ids]
        slots = torch.tensor([r.slot for r in requests], dtype=torch.int64, device=index.device)
        self.pool.sync_staged(layer, [r.slot for r in requests])
        status = entry_status(index, self.pool.masks.layer(layer).to(index.device), slots, num_heads)
        head = torch.arange(num_heads, device=index.device).unsqueeze(1).expand(num_heads, index.shape[1])
        for b, request in enumerate(requests):
            if not self._prefetches(request) or request.released or request.metrics.error or request.resuming:
                continue
            if request.deferred:
                continue
            rows = slice(b * num_heads, (b + 1) * num_heads)
            remote = status[rows] == REMOTE
            if not bool(remote.any()):
                continue
            entries = (index[rows][remote] * num_heads + head[remote]).unique().cpu()
            asked = [asked for at, asked, _, _ in request.late if at == layer]
            if asked:
                entries = entries[~torch.isin(entries, torch.cat(asked))]
                if not entries.numel():
                    continue
            request.late.append((layer, entries, self._send_fetch(request, layer, entries), time.monotonic()))
            request.metrics.prefetched_entries += int(entries.numel())
            request.remote_met.add(layer)

    def _land_fetches(self, layer: int, fetches: list, timeout: float) -> None:
        """Lands each fetch reply; a failure fails only its request.

        A request waits at most `timeout` from its fetch's sending (and its first late try) before it fails;
        with a `stall_timeout`, a fetch not back by then defers its request instead: the layer is assembled
        for the rest of the batch, and the fetch lands when it arrives (`_land_late`).
        """
        for request, entries, future, sent in fetches:
            if request.deferred:
                request.late.append((layer, entries, future, sent))
                continue
            first = request.deferred_since if request.deferred_since is not None else sent
            limit = first + timeout
            if self.stall_timeout is not None:
                limit = min(limit, sent + self.stall_timeout)
            waited = time.monotonic()
            try:
                reply: msg.FetchReply = future.result(timeout=max(0.0, limit - time.monotonic()))
            except TimeoutError:
                request.metrics.count_fetch_wait(time.monotonic() - waited)
                if self.stall_timeout is not None and time.monotonic() - first < timeout:
                    request.deferred = True
                    request.deferred_since = first
                    request.late.append((layer, entries, future, sent))
                    continue
                self.counters.add_failure("on_demand")
                self._fail_request(request.request_id, f"fetch for layer {layer} timed out after {timeout:g} s")
                continue
            except LinkLost as exc:
                if self.recompute:  # the request is opened again elsewhere (or failed, when no node is left)
                    request.deferred = True
                else:
                    self._fail_request(request.request_id, str(exc), lost=True)
                continue
            except RequestFailed as exc:
                self._fail_request(request.request_id, str(exc))
                continue
            request.metrics.count_fetch_wait(time.monotonic() - waited)
            self._land_reply(request, layer, entries, reply, sent)

    def _land_reply(
        self, request: _Request, layer: int, entries: torch.Tensor, reply: msg.FetchReply, sent: float
    ) -> None:
        expected = (entries.numel(), self.layout.head_dim)
        if reply.k is None or reply.v is None:  # the lane put it in place, where the FETCH's landing said
            if reply.landed != 2 * entries.numel() * self.layout.head_dim * self.layout.dtype.itemsize:
                self.counters.add_failure("on_demand")
                self._fail_request(request.request_id, f"fetch reply for layer {layer}: {reply.landed} bytes landed")
                return
            self.pool.entries_landed(layer, request.slot, entries)
        elif tuple(reply.k.shape) != expected or tuple(reply.v.shape) != expected:
            self.counters.add_failure("on_demand")
            self._fail_request(request.request_id, f"fetch reply for layer {layer}: K/V not of shape {expected}")
            return
        else:
            self.pool.write_entries(layer, request.slot, entries, reply.k, reply.v)
        request.fetch_counts[layer].view(-1)[entries] += 1
        request.metrics.fetched_tokens += int(torch.unique_consecutive(entries // self.layout.num_kv_heads).numel())
        self.counters.add("on_demand", reply.num_bytes, time.monotonic() - sent)

    def _land_late(self, requests: list[_Request]) -> None:
        """Lands the replies of fetches an earlier step gave up waiting for, as far as they have arrived."""
        for request in requests:
            waiting = []
            for layer, entries, future, sent in request.late:
                if not future.done():
                    waiting.append((layer, entries, future, sent))
                    continue
                try:
                    self._land_reply(request, layer, entries, future.result(), sent)
                except LinkLost as exc:
                    if not self.recompute:  # else asked again of the node it is opened on next
                        self._fail_request(request.request_id, str(exc), lost=True)
                except RequestFailed as exc:
                    self._fail_request(request.request_id, str(exc))
            request.late = waiting

    # -- stalled requests (stall_timeout) ---------------------------------------------------
    def deferred(self, request_ids: list[str]) -> list[int]:
        """Indices (into `request_ids`) of requests whose step this time waited too long for a fetch."""
        return [i for i, rid in enumerate(request_ids) if rid in self._requests and self._requests[rid].deferred]

    def undo_step(self, request_id: str) -> None:
        """Takes back a deferred request's step: the token it appended goes, the step will be done again."""
        request = self._require_any(request_id)
        self.pool.drop_last(request.slot)
        request.deferred = False

    def ready_to_resume(self, request_id: str) -> bool:
        """A deferred request may step again: its late fetches have landed (and, opened again after its prefill
        node was lost, the new node has prefilled it), or it failed (past fetch_timeout or prefill_timeout)."""
        request = self._require_any(request_id)
        if request.metrics.error:
            return True
        if request.resuming:
            if time.monotonic() - request.resumed_at > self.prefill_timeout:
                self._fail_request(request_id, f"not prefilled again within {self.prefill_timeout:g} s")
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

    def append(self, layer: int, request_id: str, k: torch.Tensor, v: torch.Tensor) -> int:
        """Adds a generated token's K/V ([H, d]) for one layer; it is local at once."""
        return self.pool.append(layer, self._require_any(request_id).slot, k, v)

    def end_step(self, request_ids: list[str]) -> None:
        """After a step: record the token, and RELEASE requests whose blocks are now all local."""
        now = time.monotonic()
        for request_id in request_ids:
            request = self._require(request_id)
            request.metrics.record_token(now)
            request.deferred_since = None
            request.remote_layers = None  # pushes and fetches landed during the step: scan again next step
            request.remote_met_before, request.remote_met = request.remote_met, set()
        self.release_fully_local(request_ids)

    def release_fully_local(self, request_ids: list[str]) -> list[str]:
        """Sends RELEASE for speculative requests whose blocks are all local; returns their ids."""
        released = []
        for request_id in request_ids:
            request = self._require(request_id)
            if request.released or not request.policy.speculative:
                continue
            self.pool.sync_staged(None, [request.slot])
            if self.pool.masks.all_local(request.slot, request.length):
                self._release(request, msg.Release(request_id))
                request.metrics.state = RequestState.FULLY_LOCAL
                request.metrics.fully_local_at = time.monotonic()
                released.append(request_id)
        return released

    def is_released(self, request_id: str) -> bool:
        return self._require(request_id).released

    def _release(self, request: _Request, message: msg.Release | msg.Abort) -> None:
        if request.released:
            return
        request.released = True
        request.link.control.send(message.pack())

    def finish(self, request_id: str) -> RequestMetrics:
        """The request is done: stop its writes, free its slot, release it on the prefill node."""
        request = self._require(request_id)
        request.link.push.revoke(request_id)
        request.link.control.drop_landings(request_id)
        self._release(request, msg.Release(request_id))
        self._cache_prompt(request)
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
        self.pool.free(request.slot)
        request.metrics.state = RequestState.ABORTED
        request.metrics.error = reason
        with self._lock:
            self._requests.pop(request_id, None)

    def _require(self, request_id: str) -> _Request:
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
