"""The prefill side of the transfer engine: request KV store, proactive and speculative pushes, fetch serving.

A request on a prefill node:
1. OPEN arrives from a decode node: the request's KV store is allocated, its transfer plan
   made (policy + profile + link timings), and it is queued for `next_request()`.
2. Prefill runs layer by layer; `prefill_layer()` stores each layer's K/V and at once
   pushes that layer's planned blocks (data, then mask) on the push lane, and
   `send_metadata()` sends the layer's selector metadata on the control lane.
3. `finish_prefill()` sends FIRST_TOKEN on the control lane (not behind bulk pushes).
4. FETCH requests are answered with the K/V of the asked tokens; each IDLE notice pushes the
   next speculative slice, in importance order, unless the previous slice is still in flight.
5. RELEASE or ABORT frees the store.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from smartgen.engine import messages as msg
from smartgen.engine.descriptors import ONES_SOURCE, block_wants, held_blocks, token_write_ops
from smartgen.engine.kv_quant import SERVING_QUANT, pack_layer
from smartgen.engine.layout import DENSE_LAYERS, KVLayout, token_blocks
from smartgen.engine.metrics import PathCounters
from smartgen.engine.planning import TransferPlan, TransferPlanner, speculative_slice_size
from smartgen.engine.policy import Policy, ProactiveMode, Strategy, get_policy
from smartgen.engine.pool import PoolGeometry, PrefillStore, RequestKV, StoreFull
from smartgen.engine.prefix_cache import PrefixCache, PrefixHit
from smartgen.lanes.base import Completion, Message, WriteOp
from smartgen.lanes.link import LinkEnd

# proactive-only: its proactive set must land before FIRST_TOKEN within this (`serve --flush-timeout`); past it the
# request fails. The decode node gives up on a first token after 120 s by default anyway.
DEFAULT_FLUSH_TIMEOUT_S = 120.0

__all__ = ["PrefillEngine", "OpenedRequest", "RequestGone", "Overloaded", "DEFAULT_FLUSH_TIMEOUT_S"]


log = logging.getLogger(__name__)


# what one more run of a push costs in descriptors (K, V and mask: 3 x about 9 us each on the TCP lane, the
# cheapest per descriptor; docs/lanes.md), against which a speculative push weighs resending a short gap
RUN_COST_S = 27e-6
# idle notices whose hints a request keeps queued; older ones are dropped (what they hinted has mostly been
# selected, and fetched, or has fallen out of the ranking since)
MAX_HINT_NOTICES = 64
# a chained speculative slice (`PrefillEngine._chain`) is what the link moves in this long: small enough that the
# freshest hints go next, large enough that a slice is not mostly its descriptors
CHAIN_WINDOW_S = 0.01
SERVE_BATCH = 64  # messages a prefill node takes off a decode node's control lane at once (see _serve)


class RequestGone(KeyError):
    """A message for a request this node no longer holds (released, aborted, or never opened)."""


class Overloaded(ValueError):
    """An OPEN refused for lack of room (the queue or the store is full): the decode node answers 503."""


@dataclass(slots=True)
class OpenedRequest:
    """A request this prefill node is serving."""

    request_id: str
    slot: int
    length: int
    policy: Policy
    plan: TransferPlan
    link: LinkEnd
    geometry: PoolGeometry
    kv: RequestKV
    ones: torch.Tensor
    prompt: torch.Tensor | None = None  # token ids, when the decode node sent them (serving)
    held_prefix: int = 0  # leading tokens the decode node's prefix cache already holds: never pushed
    # [L, n, H] bool: (token, KV head) entries no push or fetch has sent yet (held ones are sent); a push sends
    # every head of a token, a fetch only the heads a step selected
    unsent: torch.Tensor | None = None
    # the link's rate as this request's proactive pushes measured it (bytes/s; 0 until one landed), and when the
    # last idle notice came: a speculative slice is sized to what the link moves between two notices
    link_rate: float = 0.0
    first_push: float | None = None
    pushed_bytes: int = 0
    last_idle: float | None = None
    fetched_since_idle: int = 0  # reply bytes this node sent the request's fetches since its last idle notice
    prefix_hit: PrefixHit | None = None  # this node's cached prefix, pinned while the request prefills
    sent: torch.Tensor | None = None  # [L, M_eff] bool: blocks pushed proactively (set by prefill_layer)
    spec_order: torch.Tensor | None = None  # flat ids still to push speculatively, made when speculation starts
    spec_cursor: int = 0
    spec_in_flight: Completion | None = None
    # flat ids (layer * length + token) the decode node's idle notices hinted at, one tensor per notice, newest
    # last: speculation pushes them, newest first, before the plan's speculative order
    hint_queue: list[torch.Tensor] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)
    held: torch.Tensor | None = None  # [L, n] bool: tokens the decode node already holds (never pushed)
    resumed: bool = False  # the decode node had decoded it already: no metadata, FIRST_TOKEN only says "ready"

    @property
    def speculation_done(self) -> bool:
        order = self.plan.speculative_order if self.spec_order is None else self.spec_order
        return self.spec_cursor >= order.numel()

    def speculative_order(self) -> torch.Tensor:
        """Every block not pushed yet: the plan's proactive blocks a query pick replaced first, then the plan's
        speculative order; blocks the query pick pushed out of that order are skipped."""
        if self.spec_order is None:
            plan = self.plan
            ranking = torch.cat([plan.proactive.flatten().nonzero().flatten(), plan.speculative_order])
            sent = self.sent.flatten() if self.sent is not None else plan.proactive.flatten()
            self.spec_order = ranking[~sent[ranking]]
        return self.spec_order


class PrefillEngine:
    """Serves the decode nodes attached to it; `prefill_layer` is called by the model runtime."""

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
        self.layout = layout
        self.prefix_cache = prefix_cache or PrefixCache(0)
        self.held_saved = PathCounters()  # per path: KV bytes not pushed because the decode node held them
        self.max_queue = max_queue
        self.flush_timeout_s = flush_timeout_s
        self.planner = planner
        self.store = PrefillStore(layout, max_store_bytes)
        self.counters = PathCounters()  # KV bytes per path (masks and headers not counted)
        self.oracle_counts: dict[str, torch.Tensor] = {}  # request_id -> [L, H, n] for the "optimal" strategy
        self._requests: dict[str, OpenedRequest] = {}
        self._lock = threading.Lock()
        self._opened: queue.Queue[OpenedRequest] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._links: list[LinkEnd] = []
        self._packer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quant-pack")  # quant2's layers, in order
        # plans and posts every speculative slice (an idle notice's, `push_speculative`, and a chained one's,
        # `_chain`), off the thread that serves fetches: planning a slice of scattered tokens takes milliseconds
        # that a fetch must not queue behind. The lock keeps direct calls (tests, tools) and this thread apart.
        self._speculation = ThreadPoolExecutor(max_workers=1, thread_name_prefix="speculation")
        self._spec_lock = threading.RLock()
        self._hint_lock = threading.Lock()  # hint queues: filled by the serving thread, taken by speculation

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
            unsent=_unsent(self.layout.num_layers, length, self.layout.num_kv_heads, message.held, message.held_prefix),
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
        (pinned until `cache_prefix`), or None. On a hit the plan is made again: K_r counts the prefill
        time of the tokens really computed, while the plan still covers the whole prompt."""
        if request.prompt is None or not self.prefix_cache.enabled:
            return None
        hit = self.prefix_cache.match(request.prompt, max_tokens=request.length - 1)  # one token is computed
        if hit is None:
            return None
        request.prefix_hit = hit
        policy = request.policy
        # K_r only matters under a budget; the optimal strategy's counts were used up by the first plan; a
        # drop-remote policy's answers depend on its proactive set, which must not depend on the cache's state
        if policy.proactive == ProactiveMode.BUDGET and policy.strategy != Strategy.OPTIMAL and not policy.drop_remote:
            request.plan = self.planner.plan(
                request.length,
                policy.proactive,
                policy.strategy,
                computed=request.length - hit.tokens,
                held=request.held_prefix,
            )
        return hit.kv()

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

    def _get(self, request_id: str) -> OpenedRequest | None:
        with self._lock:
            return self._requests.get(request_id)

    def prefill_layer(
        self,
        request_id: str,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        token_scores: torch.Tensor | None = None,
    ) -> int:
        """Stores one prefilled layer ([n, H, d] each) and pushes its planned blocks; returns bytes posted.

        `token_scores` [n]: how much the prompt's last query attends to each token in this layer. Under
        the "query" strategy the layer's share of K_r goes to the blocks with the highest ones.
        """
        request = self._get(request_id)
        if request is None:
            raise RequestGone(f"request {request_id!r} is not open on this prefill node")
        self.store.put_layer(request_id, layer, k, v)
        if request.policy.quantize_bits:  # packed off the prefill thread, in layer order (one packer)
            self._packer.submit(self._push_quantized, request, layer)
            return 0
        blocks = request.plan.proactive_blocks(layer)
        if token_scores is not None and request.policy.strategy == Strategy.QUERY and layer >= DENSE_LAYERS:
            if request.held_prefix:  # held blocks cost nothing and fill their share of the pick first
                token_scores = token_scores.clone()
                token_scores[: request.held_prefix] = float("inf")
            blocks = query_blocks(token_scores, request.length, request.plan.num_blocks, blocks.numel())
        if request.sent is None:
            request.sent = torch.zeros_like(request.plan.proactive)
        request.sent[layer, blocks] = True
        return self._push(request, [(layer, blocks)], tag="proactive")

    def send_metadata(self, request_id: str, layer: int, metadata: dict[str, torch.Tensor]) -> int:
        """One layer's selector metadata, sent the moment the layer is prefilled.

        It goes on the control lane, ahead of bulk pushes and before FIRST_TOKEN, so the
        decode node has it for its first step without it adding to the time to first token. Returns the
        bytes sent (0 when nothing was).
        """
        request = self._get(request_id)
        if request is None or not metadata or request.resumed:
            return 0
        message = msg.Metadata(request_id, int(layer), metadata).pack()
        request.link.control.send(message, tag="metadata")
        self.counters.add("metadata", message.payload_bytes)
        return message.payload_bytes

    def finish_prefill(
        self, request_id: str, first_token: int, metadata: list[dict[str, torch.Tensor]] | None = None
    ) -> None:
        """FIRST_TOKEN, carrying the selector metadata the decode node needs before its first step.

        Under a policy that drops remote entries (proactive-only) what the decode node attends must
        not depend on thread timing, so the proactive set lands before FIRST_TOKEN leaves.
        """
        request = self._get(request_id)
        if request is None:
            raise RequestGone(f"request {request_id!r} is not open on this prefill node")
        if request.policy.drop_remote and not request.link.push.flush(timeout=self.flush_timeout_s):
            raise TimeoutError(f"the proactive set of {request_id} did not land within {self.flush_timeout_s:g} s")
        metadata = None if request.resumed else metadata  # a resumed request's decode node kept its metadata
        cached = request.prefix_hit.tokens if request.prefix_hit is not None else 0
        message = msg.FirstToken(request_id, int(first_token), msg.pack_metadata(metadata or []), cached).pack()
        request.link.control.send(message, tag="metadata")
        self.counters.add("metadata", message.payload_bytes)

    def fail(self, request_id: str, reason: str) -> None:
        """Prefill of a request failed here: tell its decode node why, and free it."""
        request = self._get(request_id)
        if request is not None:
            request.link.control.send(msg.Error(request_id, reason).pack())
        self.release(request_id)

    def push_speculative(self, request: OpenedRequest) -> int:
        """Pushes the next slice of unsent blocks, most important first; 0 if one is still in flight. Called on
        every idle notice; the slice is what the link moves in the time since the last one."""
        with self._spec_lock:
            now = time.monotonic()
            window = now - request.last_idle if request.last_idle is not None else 0.0
            request.last_idle = now
            fetched, request.fetched_since_idle = request.fetched_since_idle, 0
            return self._push_next_slice(request, window, fetched)

    def _chain(self, request: OpenedRequest) -> None:
        """A speculative slice landed: push the next one now, sized to CHAIN_WINDOW_S of link, rather than wait
        for the next idle notice. The decode node sends none while its fetches are on the link, and the link
        went idle in between (16-layer sample: link% 64 with notices alone, 68-88 chained). Fetches lose nothing:
        the pacer makes a bulk lane hold back while an on-demand reply is queued (`Pacer.urgent_enqueued`)."""
        with self._spec_lock:
            if self._get(request.request_id) is not request or request.last_idle is None:
                return  # released (all local, or aborted), or not decoding yet
            try:
                self._push_next_slice(request, CHAIN_WINDOW_S, 0)
            except Exception:  # a broken link fails the request elsewhere; the chain just stops
                log.debug("prefill: chained speculation for %s stopped", request.request_id, exc_info=True)

    def _push_next_slice(self, request: OpenedRequest, window: float, fetched: int) -> int:
        if not request.policy.speculative or request.speculation_done:
            return 0
        if request.spec_in_flight is not None and not request.spec_in_flight.done():
            return 0
        if request.kv.layers_ready < self.layout.num_layers:
            return 0  # speculation starts once prefill is over
        if request.hint_queue and request.unsent is not None:
            hinted = self._take_hinted(request, window, fetched)
            if hinted is not None:
                return hinted
        total = request.plan.num_layers * request.plan.num_blocks
        size = speculative_slice_size(total, request.policy.speculative_ratio)
        ahead = request.speculative_order()[request.spec_cursor :]
        if request.unsent is not None:  # blocks on-demand fetches already brought whole are skipped, not resent
            blocks = token_blocks(request.length, self.layout.num_blocks)
            pending = torch.zeros(request.plan.num_layers, request.plan.num_blocks).index_add_(
                1, blocks, request.unsent.any(dim=-1).float()
            )
            keep = pending.flatten()[ahead] > 0
            count = self._slice_blocks(request.link_rate, window, pending.flatten()[ahead[keep]], size, fetched)
            if keep.any() and count == 0:
                return 0  # the window's link time went to fetches: nothing is idle to speculate with
            taken = keep.nonzero().flatten()[:count]
            ids = ahead[taken]
            request.spec_cursor += int(taken[-1]) + 1 if taken.numel() else ahead.numel()
        else:
            ids = ahead[:size]
            request.spec_cursor += ids.numel()
        if not ids.numel():
            return 0
        layer_of = ids // request.plan.num_blocks
        layer_blocks = [(int(layer), ids[layer_of == layer] % request.plan.num_blocks) for layer in layer_of.unique()]
        return self._push(request, layer_blocks, tag="speculative")

    def _slice_blocks(
        self, link_rate: float, window: float, pending_tokens: torch.Tensor, limit: int, fetched: int = 0
    ) -> int:
        """How many of the next blocks (their unsent token counts, in order) one speculative slice takes: what the
        link moves in one idle window (between two idle notices) at the rate the proactive pushes measured, at
        least one block, at most `limit` (the speculative ratio). A slice still on the link when the next fetch
        comes is sent twice for every token that fetch wants (fetches pre-empt pushes), so big slices cost bytes.
        Without a window yet (the first notice of a request's decoding: its first step is about to fetch what it
        lacks, and that fetch is what TTST waits for): one block. Without a measured rate yet: `limit`.
        `fetched`: reply bytes sent for the request's fetches in the window, link time that was not idle; when
        they took all of it, no block (0): speculation waits for a window the fetches leave free."""
        if window <= 0:
            return 1
        if link_rate <= 0:
            return limit
        budget = link_rate * window - fetched
        if fetched and budget <= 0:
            return 0
        cumulative = torch.cumsum(pending_tokens * 2 * self.layout.token_bytes, 0)
        return max(1, min(limit, int((cumulative <= budget).sum())))

    def note_hints(self, request: OpenedRequest, hints: torch.Tensor) -> None:
        """Queues the tokens an IDLE notice hinted at (flat ids layer * length + token: what the decode node's
        selector ranked just past its budget); speculation pushes them, newest notice first, ahead of the
        plan's order (`push_speculative`)."""
        if not request.policy.speculative or not hints.numel():
            return
        length, num_layers = request.length, self.layout.num_layers
        if int(hints.min()) < 0 or int(hints.max()) >= num_layers * length:
            raise msg.MessageError(f"IDLE: hints outside the {num_layers} x {length} prompt of {request.request_id!r}")
        with self._hint_lock:  # the speculation thread takes from the queue meanwhile
            request.hint_queue.append(hints)
            del request.hint_queue[:-MAX_HINT_NOTICES]

    def _take_hinted(self, request: OpenedRequest, window: float, fetched: int) -> int | None:
        """Pushes hinted tokens still unsent, newest notice first, as many as one idle window of the link moves
        (`_slice_blocks`' rule, in tokens); None when no hinted token is left to send. A step's hints are what
        the next steps are likeliest to select, and a notice's hints grow stale as decoding moves on: pushing every
        notice's hints at once (as this did before) queued more bytes than the link moved between two steps, so
        the freshest waited behind the stale."""
        assert request.unsent is not None
        unsent = request.unsent.any(dim=-1).flatten()
        token_cost = 2 * self.layout.token_bytes
        room: int | None
        if window > 0 and request.link_rate > 0:
            budget = request.link_rate * window - fetched
            if fetched and budget <= 0:
                return 0  # the window went to fetches: nothing is idle to speculate with
            room = max(1, int(budget // token_cost))
        else:
            # no rate yet: this notice's hints, whole; no window yet (the first notice, which brings the hints the
            # first step gathered: on 32 layers 1.5 MiB, half a second of link): one chained slice's worth
            room = None if request.link_rate <= 0 else max(1, int(request.link_rate * CHAIN_WINDOW_S // token_cost))
        taken: list[torch.Tensor] = []
        with self._hint_lock:
            while request.hint_queue and (room is None or room > 0):
                ids = request.hint_queue.pop()
                ids = ids[unsent[ids]]
                if room is not None and ids.numel() > room:
                    request.hint_queue.append(ids[room:])  # the rest stays newest, for the next window
                    ids = ids[:room]
                taken.append(ids)
                if room is None:
                    break
                room -= ids.numel()
        ids = torch.cat(taken) if taken else torch.empty(0, dtype=torch.int64)
        if not ids.numel():
            return None
        want = torch.zeros(unsent.numel(), dtype=torch.bool)
        want[ids] = True
        want = want.view(self.layout.num_layers, request.length)
        layer_wants = [(int(layer), want[layer]) for layer in want.any(dim=1).nonzero().flatten()]
        return self._push_tokens(request, layer_wants, tag="speculative")

    def _push(self, request: OpenedRequest, layer_blocks: list[tuple[int, torch.Tensor]], tag: str) -> int:
        return self._push_tokens(request, block_wants(request.length, request.geometry, layer_blocks), tag)

    def _push_tokens(self, request: OpenedRequest, layer_wants: list[tuple[int, torch.Tensor]], tag: str) -> int:
        bridge, resendable = self._bridge(request) if tag == "speculative" else (0, None)
        ops, kv_bytes = token_write_ops(
            request.geometry, request.kv, request.slot, layer_wants, request.unsent, bridge, resendable
        )
        full = tag == "proactive" and request.policy.proactive == ProactiveMode.ALL  # full transfer, not a chosen set
        path = "full" if full else tag
        held_tokens = 0
        for layer, want in layer_wants:
            held_tokens += int(want[: request.held_prefix].sum())
            if request.unsent is not None:
                request.unsent[layer, want] = False
        if held_tokens:
            self.held_saved.add(path, self.layout.kv_bytes(held_tokens, num_layers=1))
        if not ops:
            return 0
        sources = {**request.kv.byte_views(), ONES_SOURCE: request.ones}
        completion = request.link.push.post_writes(request.request_id, sources, ops, tag=tag)
        self.counters.add(path, kv_bytes)
        posted = time.monotonic()

        if tag == "proactive" and request.first_push is None:
            request.first_push = posted

        def landed(applied: bool) -> None:  # posting to applied at the decode node: the push's transfer time
            if applied:  # a batch dropped because its request ended meanwhile is no transfer (and no failure)
                now = time.monotonic()
                self.counters.add_time(path, now - posted)
                if tag == "proactive" and request.first_push is not None and now > request.first_push:
                    request.pushed_bytes += kv_bytes  # pushes go back to back: their span is the link's pace
                    request.link_rate = request.pushed_bytes / (now - request.first_push)

        completion.add_done_callback(landed)
        if tag == "speculative":
            request.spec_in_flight = completion
            if request.policy.chain:

                def chain(applied: bool) -> None:
                    if applied:
                        self._submit_chain(request)

                completion.add_done_callback(chain)
        return kv_bytes

    def _submit_chain(self, request: OpenedRequest) -> None:
        self._submit_speculation(self._chain, request)

    def _submit_speculation(self, work: Callable[[OpenedRequest], object], request: OpenedRequest) -> None:
        try:
            self._speculation.submit(work, request)
        except RuntimeError:  # the engine is closing
            pass

    def _speculate_on_notice(self, request: OpenedRequest) -> None:
        """An idle notice's slice, on the speculation thread; a failure there stops it, never the node."""
        if self._get(request.request_id) is not request:
            return  # released meanwhile
        try:
            self.push_speculative(request)
        except Exception:
            log.exception("prefill: speculation for %s failed", request.request_id)

    def _bridge(self, request: OpenedRequest) -> tuple[int, torch.Tensor | None]:
        """Longest gap of already-sent tokens a speculative run sends again rather than split around it, and
        which tokens may be: the bytes of a gap must cost the link less than the three descriptors (K, V, mask)
        splitting adds (RUN_COST_S), at the rate this request's pushes measured. On a slow link that is no
        token at all; on a fast one, fetched tokens scattered through a block range stop fragmenting it.
        Only entries this node sent in this request are resent: their bytes are the ones the decode node holds.
        `resendable` is [L, n, H], per (token, head) entry, as pushes are."""
        if request.unsent is None or request.link_rate <= 0:
            return 0, None
        tokens = int(request.link_rate * RUN_COST_S / (2 * self.layout.token_bytes))
        if tokens <= 0:
            return 0, None
        resendable = ~request.unsent  # [L, n, H]: entries already sent
        resendable[:, : request.held_prefix] = False
        if request.held is not None:
            resendable &= ~request.held[..., None]
        return tokens, resendable

    def _push_quantized(self, request: OpenedRequest, layer: int) -> int:
        """Quantized full transfer: the layer packed (`engine.kv_quant`) into the decode node's staging region,
        then its flag; the decode node dequantizes it into the pool. A layer the decode node holds already (a
        lost prefill node's request opened again here) is not sent. Runs on the packer thread, so a failure
        fails the request here instead of raising."""
        if self._get(request.request_id) is not request:
            return 0  # released (or aborted) while its layers waited to be packed
        try:
            return self._pack_and_post(request, layer)
        except Exception as exc:  # a bug must not silently stall the request: it fails with the reason
            log.exception("prefill: packing layer %d of %s failed", layer, request.request_id)
            self.fail(request.request_id, f"quantized transfer failed: {exc}")
            return 0

    def _pack_and_post(self, request: OpenedRequest, layer: int) -> int:
        k, v = request.kv.k[layer, : request.length], request.kv.v[layer, : request.length]
        if request.unsent is not None:
            if not bool(request.unsent[layer].any()):
                return 0
            request.unsent[layer] = False
        packed = pack_layer(k, v, SERVING_QUANT)
        geometry = request.geometry
        if packed.numel() > geometry.quant_layer_bytes:  # the slot holds the prompt, so this is a bug: say so
            raise ValueError(f"a packed layer of {request.length} tokens overflows the staging slot")
        ops = [
            WriteOp("packed", "quant", 0, geometry.quant_offset(layer, request.slot), packed.numel()),
            WriteOp(ONES_SOURCE, "quant_ready", 0, geometry.ready_offset(layer, request.slot), 1),
        ]
        self.counters.add("full", packed.numel())  # before posting: a status read after the request ends counts it
        completion = request.link.push.post_writes(
            request.request_id, {"packed": packed, ONES_SOURCE: request.ones}, ops, tag="proactive"
        )
        posted = time.monotonic()

        def landed(applied: bool) -> None:
            if applied:
                self.counters.add_time("full", time.monotonic() - posted)

        completion.add_done_callback(landed)
        return packed.numel()

    def _serve_fetch(self, link: LinkEnd, message: msg.Fetch) -> None:
        request = self._get(message.request_id)
        if request is None:
            raise RequestGone(f"request {message.request_id!r} is not open on this prefill node")
        layer, positions, heads = message.layer, message.positions, message.heads
        if not 0 <= layer < self.layout.num_layers:
            raise msg.MessageError(f"FETCH: no layer {layer} in a {self.layout.num_layers}-layer model")
        if positions.numel() and not (0 <= int(positions.min()) and int(positions.max()) < request.length):
            raise msg.MessageError(
                f"FETCH: positions outside the {request.length}-token prompt of {message.request_id!r}"
            )
        if request.kv.layers_ready <= layer:
            raise ValueError(f"layer {layer} of {message.request_id!r} is not prefilled yet")
        if heads is not None and tuple(heads.shape) != (positions.numel(), self.layout.num_kv_heads):
            raise msg.MessageError(f"FETCH: heads must be [{positions.numel()}, {self.layout.num_kv_heads}] bool")
        k, v = request.kv.k[layer, positions], request.kv.v[layer, positions]  # [p, H, d]
        if heads is None:  # every head of each token
            k, v = k.contiguous(), v.contiguous()
            if request.unsent is not None:
                request.unsent[layer, positions] = False  # a speculative push will not send these again
        else:  # only the (token, head) entries asked for: [E, d], token-major
            k, v = k[heads], v[heads]
            if request.unsent is not None:
                sent = request.unsent[layer, positions]
                sent[heads] = False
                request.unsent[layer, positions] = sent  # a push still sends a token while any head is unsent
        reply = msg.FetchReply(message.request_id, message.fetch_id, k, v).pack()
        link.control.send(reply, tag="on_demand")
        self.counters.add("on_demand", reply.payload_bytes)
        request.fetched_since_idle += reply.payload_bytes

    def release(self, request_id: str) -> bool:
        """Frees a request's KV (RELEASE, ABORT, or its decode node gone)."""
        with self._lock:
            self._requests.pop(request_id, None)
        return self.store.release(request_id)

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
    """One request's idle notices as one: the last one's layer, every notice's hints."""
    unpacked = [msg.Idle.unpack(notice) for notice in notices]
    hints = [notice.hints for notice in unpacked if notice.hints is not None]
    merged = torch.cat(hints).unique() if hints else None
    return msg.Idle(unpacked[-1].request_id, unpacked[-1].layer, merged)


def query_blocks(token_scores: torch.Tensor, length: int, num_blocks: int, count: int) -> torch.Tensor:
    """The `count` blocks holding the highest token scores (a block scores its best token), ascending ids."""
    if count <= 0:
        return torch.zeros(0, dtype=torch.int64)
    blocks = token_blocks(length, num_blocks)
    m_eff = int(blocks[-1]) + 1
    best = torch.full((m_eff,), float("-inf")).scatter_reduce(0, blocks, token_scores.float().cpu(), "amax")
    return torch.sort(torch.topk(best, min(count, m_eff)).indices).values


def _unsent(num_layers: int, length: int, num_heads: int, held: torch.Tensor | None, held_prefix: int) -> torch.Tensor:
    """[L, n, H] bool: the entries a new request's decode node lacks (not in its prefix cache, not kept from a
    lost prefill node): every push and fetch clears what it sends, so nothing is sent twice."""
    unsent = (torch.arange(length) >= held_prefix).repeat(num_layers, 1)
    if held is not None:
        unsent &= ~held
    return unsent.unsqueeze(-1).repeat(1, 1, num_heads)
