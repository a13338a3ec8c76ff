"""The prefill side's link and failure control, and a request's life on it (the package docstring lists it)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import torch

from smartgen.engine import messages as msg
from smartgen.engine.descriptors import held_blocks
from smartgen.engine.index_ops import distinct_in_order
from smartgen.engine.layout import KVLayout
from smartgen.engine.planning import TransferPlanner, defer_proactive, prefix_blocks
from smartgen.engine.policy import get_policy
from smartgen.engine.pool import PoolGeometry, StoreFull
from smartgen.engine.prefill.decide import unsent_entries
from smartgen.engine.prefill.move import PrefillPath
from smartgen.engine.prefill.request import OpenedRequest, Overloaded, RequestGone
from smartgen.engine.prefix_cache import PrefixCache
from smartgen.lanes.base import Message
from smartgen.lanes.link import LinkEnd

# proactive-only: its proactive set must land before FIRST_TOKEN within this (`serve --flush-timeout`); past it the
# request fails. The decode node gives up on a first token after 120 s by default anyway.
DEFAULT_FLUSH_TIMEOUT_S = 120.0
SERVE_BATCH = 64  # messages a prefill node takes off a decode node's control lane at once (see _serve)

__all__ = ["PrefillEngine", "DEFAULT_FLUSH_TIMEOUT_S"]

log = logging.getLogger(__name__)


class PrefillEngine(PrefillPath):
    """Serves the decode nodes attached to it; `prefill_layer` (`PrefillPath`) is called by the model runtime."""

    def __init__(
        self,
        layout: KVLayout,
        planner: TransferPlanner,
        max_queue: int = 64,
        flush_timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S,
        max_store_bytes: int | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        """`prefix_cache`: prompts' KV by token blocks; a request whose prompt starts with cached blocks
        prefills only the rest (see `lookup_prefix`, `cache_prefix`)."""
        super().__init__(layout, max_store_bytes, flush_timeout_s)
        self.prefix_cache = prefix_cache or PrefixCache(0)
        self.max_queue = max_queue
        self.planner = planner
        self.oracle_counts: dict[str, torch.Tensor] = {}  # request_id -> [L, H, n] for the "optimal" strategy
        self._opened: queue.Queue[OpenedRequest] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._links: list[LinkEnd] = []

    # -- connections ------------------------------------------------------------------
    def attach(self, link: LinkEnd, geometry: PoolGeometry) -> None:
        """Serves one decode node over `link`; `geometry` is its pool's (exchanged at the handshake)."""
        with self._lock:
            self._links.append(link)
        thread = threading.Thread(target=self._serve, args=(link, geometry), name="prefill-serve", daemon=True)
        thread.start()
        self._threads.append(thread)

    @property
    def links(self) -> list[LinkEnd]:
        """The decode nodes connected now."""
        with self._lock:
            return list(self._links)

    def close(self) -> None:
        self._packer.shutdown(wait=False, cancel_futures=True)
        self._speculation.shutdown(wait=False, cancel_futures=True)
        for link in self.links:
            link.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def _serve(self, link: LinkEnd, geometry: PoolGeometry) -> None:
        while True:
            message = link.control.recv(timeout=0.25)
            if message is None:
                if link.alive:
                    continue
                link.close()  # one lane broke (lease expired, bad frame): the decode node is gone as a whole
                self._drop_link(link)
                return
            # what else has arrived is served with it: fetches (and every other message, in order) first, then one
            # idle notice per request with the hints of all of them. A decode node sends a notice per layer, and
            # working through each in turn (a speculative slice is planned per notice) kept fetches waiting behind
            # them: the first decode steps' fetch latency is what TBT pays.
            batch = [message]
            while len(batch) < SERVE_BATCH and (more := link.control.recv(timeout=0)) is not None:
                batch.append(more)
            idle: dict[str, list[Message]] = {}
            for message in batch:
                if message.kind == msg.MessageKind.IDLE:
                    idle.setdefault(message.request_id, []).append(message)
                else:
                    self._serve_one(link, geometry, [message], _unpack_last)
            for notices in idle.values():
                self._serve_one(link, geometry, notices, _merged_idle)

    def _serve_one(
        self,
        link: LinkEnd,
        geometry: PoolGeometry,
        messages: list[Message],
        unpack: Callable[[list[Message]], msg.EngineMessage],
    ) -> None:
        """Serves what `unpack` makes of `messages` (one message, or one request's idle notices)."""
        message = messages[-1]
        try:
            self._handle(link, geometry, unpack(messages))
        except RequestGone as exc:  # released or aborted meanwhile (a late fetch): nothing to serve
            log.info("prefill: %s for %s dropped: %s", message.kind.name, message.request_id, exc)
        except ValueError as exc:  # a request this node refuses (busy, no profile, bad message): say why
            log.warning("prefill: %s for %s refused: %s", message.kind.name, message.request_id, exc)
            overloaded = isinstance(exc, Overloaded)
            link.control.send(msg.Error(message.request_id, str(exc), overloaded).pack())
        except Exception as exc:  # a bug must not take the node down; it keeps its traceback in the log
            log.exception("prefill: %s for %s failed", message.kind.name, message.request_id)
            link.control.send(msg.Error(message.request_id, str(exc)).pack())

    def _handle(self, link: LinkEnd, geometry: PoolGeometry, message: msg.EngineMessage) -> None:
        match message:
            case msg.Open():
                self._open(link, geometry, message)
            case msg.Fetch():
                self._serve_fetch(link, message)
            case msg.Attend():
                self._serve_attend(link, message)
            case msg.Idle():
                request = self._get(message.request_id)
                if request is not None:
                    if message.hints is not None:
                        self.note_hints(request, message.hints)
                    self._submit_speculation(self._speculate_on_notice, request)
            case msg.Release() | msg.Abort():
                self.release(message.request_id)
            case _:
                raise msg.MessageError(f"a prefill node does not take {type(message).__name__.upper()} messages")

    def _drop_link(self, link: LinkEnd) -> None:
        """The decode node is gone (closed, or silent past its lease): free every request it had here."""
        with self._lock:
            gone = [rid for rid, req in self._requests.items() if req.link is link]
            if link in self._links:
                self._links.remove(link)
        # an orderly close with nothing in flight (a pipeline or node shutting down) is news, not a warning
        level = logging.WARNING if gone or link.error else logging.INFO
        log.log(
            level, "prefill: a decode node's link closed (%s); freed %d request(s)", link.error or "closed", len(gone)
        )
        for request_id in gone:
            self.release(request_id)
        self.gate.forget(id(link))

    # -- request life -----------------------------------------------------------------
    def _open(self, link: LinkEnd, geometry: PoolGeometry, message: msg.Open) -> None:
        if self._opened.qsize() >= self.max_queue:
            raise Overloaded(f"prefill node is busy: {self.max_queue} requests already queued; try again later")
        if message.held is not None and message.held.shape[0] != self.layout.num_layers:
            raise msg.MessageError(f"OPEN: 'held' has {message.held.shape[0]} layers, not {self.layout.num_layers}")
        if message.oracle_counts is not None and message.oracle_counts.shape[0] != self.layout.num_layers:
            raise msg.MessageError(
                f"OPEN: 'oracle_counts' has {message.oracle_counts.shape[0]} layers, not {self.layout.num_layers}"
            )
        policy = get_policy(message.scheme, message.strategy, message.speculative_ratio)
        length = message.length
        if not 0 <= message.held_prefix <= length:
            raise msg.MessageError(f"OPEN: {message.held_prefix} held tokens of a {length}-token prompt")
        oracle = self.oracle_counts.pop(message.request_id, None)  # the simulator's; a serving request brings its own
        if message.oracle_counts is not None:
            oracle = message.oracle_counts
        plan = self.planner.plan(length, policy.proactive, policy.strategy, oracle, held=message.held_prefix)
        try:
            kv = self.store.open(message.request_id, length)
        except StoreFull as exc:
            raise Overloaded(str(exc)) from None
        request = OpenedRequest(
            message.request_id,
            message.slot,
            length,
            policy,
            plan,
            link,
            geometry,
            kv,
            ones=torch.ones(max(1, length * self.layout.num_kv_heads), dtype=torch.uint8),
            prompt=message.prompt_ids,
            held_prefix=message.held_prefix,
            held=message.held,
            resumed=message.resumed,
            head_tokens=message.head_tokens if policy.head_start and not message.resumed else 0,
            unsent=unsent_entries(
                self.layout.num_layers, length, self.layout.num_kv_heads, message.held, message.held_prefix
            ),
        )
        if message.held is not None:  # opened again elsewhere (recompute): what the decode node has stays there
            request.sent = held_blocks(message.held, self.layout.num_blocks)
        with self._lock:
            self._requests[message.request_id] = request
        self._opened.put(request)

    def next_request(self, timeout: float | None = None) -> OpenedRequest | None:
        """The next opened request to prefill (None after `timeout`)."""
        try:
            return self._opened.get(timeout=timeout)
        except queue.Empty:
            return None

    def lookup_prefix(self, request: OpenedRequest) -> tuple[torch.Tensor, torch.Tensor] | None:
        """At the start of a request's prefill: the K/V [L, P, H, d] of its prompt's cached leading blocks
        (pinned until `cache_prefix`), or None. `begin_prefill` then plans again for the tokens computed."""
        if request.prompt is None or not self.prefix_cache.enabled:
            return None
        hit = self.prefix_cache.match(request.prompt, max_tokens=request.length - 1)  # one token is computed
        if hit is None:
            return None
        request.prefix_hit = hit
        return hit.kv()

    def begin_prefill(self, request: OpenedRequest, computed: int, *, head_start: bool = False) -> None:
        """As a request's prefill starts, its plan is made again where K_r has changed since OPEN. After a prefix hit
        K_r counts the prefill time of the `computed` tokens only (the plan still covers the whole prompt). Under a
        scheduled policy, pushes of earlier requests still on its link go first, so K_r counts only the rest of
        the window. A batch's proactive sets each sized for the whole window queued every later request's layers
        0-1 behind them, and those are what a request waits for to join a running batch.

        `head_start`: this node expects to decode the request on from its second token (Policy.head_start, no other
        prompt waiting). Its decode node then takes over only once its whole KV has landed, so K_r buys it nothing;
        where requests handed on earlier still fetch over the same link, only layers 0-1 go proactively (what the
        decode node needs if a prompt arrives and cuts the head start short), and the rest of the prefill window's
        link goes to their speculation: the blocks K_r would have pushed lead this request's speculative order."""
        if not request.flags.replan_on_prefix:
            return
        backlog = self.gate.in_flight(id(request.link)) if request.flags.schedule else 0
        if computed < request.length or backlog:  # else the plan made at OPEN stands
            request.plan = self.planner.plan(
                request.length,
                request.policy.proactive,
                request.policy.strategy,
                computed=computed,
                held=request.held_prefix,
                backlog=backlog / self.layout.kv_bytes(1),  # in tokens' worth of whole-model KV
            )
        if head_start and request.flags.defer_proactive and self._handed_on_behind(request):
            # the plan just made stands again if a prompt arrives mid-prefill (`_undefer`)
            held = prefix_blocks(request.length, self.layout.num_blocks, request.held_prefix)
            request.deferred_plan, request.plan = request.plan, defer_proactive(request.plan, keep_blocks=held)

    def cache_prefix(self, request: OpenedRequest, raw: tuple[torch.Tensor, torch.Tensor] | None = None) -> int:
        """After a request's prefill: unpins its hit and caches its prompt's new whole blocks; `raw` is the K/V
        [L, n, H, d] as computed when the store holds transformed K/V (quantized). Returns blocks added."""
        hit, request.prefix_hit = request.prefix_hit, None
        try:
            if (
                request.prompt is None
                or not self.prefix_cache.enabled
                or request.kv.layers_ready < self.layout.num_layers
            ):
                return 0
            k, v = raw if raw is not None else (request.kv.k, request.kv.v)
            block = self.prefix_cache.block_tokens
            start = (hit.tokens // block) * block if hit is not None else 0
            return self.prefix_cache.insert(request.prompt, k[:, start:], v[:, start:], start=start)
        finally:
            self.prefix_cache.release(hit)

    def fail(self, request_id: str, reason: str) -> None:
        """Prefill of a request failed here: tell its decode node why, and free it."""
        request = self._get(request_id)
        if request is not None:
            request.link.control.send(msg.Error(request_id, reason).pack())
        self.release(request_id)

    def release(self, request_id: str) -> bool:
        """Frees a request's KV (RELEASE, ABORT, or its decode node gone)."""
        with self._lock:
            request = self._requests.pop(request_id, None)
        if request is not None:
            self.gate.drop(id(request.link), request_id)
        return self.store.release(request_id)

    def head_start_wanted(self, request_id: str, decoded: int) -> bool:
        """Whether this node decodes one more token of the request ahead of its decode node (Policy.head_start),
        `decoded` past the second so far: the request is still here, OPEN allowed that many more, no other request
        waits for prefill (a head start only uses a prefill node's idle time), and some of its KV has not landed yet
        (unsent, or posted and on its way: once it has all landed, the decode node's steps find every pick local)."""
        request = self._get(request_id)
        if request is None or decoded >= request.head_tokens or self.num_queued:
            return False
        with self._lock:
            if request.pushes_in_flight:
                return True
        return request.unsent is not None and bool(request.unsent.any())

    def _prompt_waiting(self) -> bool:
        return self.num_queued > 0

    @property
    def num_queued(self) -> int:
        """Opened requests waiting for prefill."""
        return self._opened.qsize()

    @property
    def num_open(self) -> int:
        with self._lock:
            return len(self._requests)


def _unpack_last(messages: list[Message]) -> msg.EngineMessage:
    return msg.unpack(messages[-1])


def _merged_idle(notices: list[Message]) -> msg.Idle:
    """One request's idle notices as one: the last one's layer, every notice's hints, the newest notice's first (each
    notice's own order kept: likeliest first, `decode.decide.hinted`)."""
    unpacked = [msg.Idle.unpack(notice) for notice in notices]
    hints = [notice.hints for notice in reversed(unpacked) if notice.hints is not None]
    merged = distinct_in_order(torch.cat(hints)) if hints else None
    return msg.Idle(unpacked[-1].request_id, unpacked[-1].layer, merged)
