"""The prefill side's data path: a request's store, its proactive and speculative pushes, fetches served."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

import smartgen.engine.prefill.decide as decide
from smartgen.engine import messages as msg
from smartgen.engine.attention import partial_attention
from smartgen.engine.descriptors import ONES_SOURCE, block_entries, block_wants, entry_write_ops, token_write_ops
from smartgen.engine.kv_quant import SERVING_QUANT, pack_layer
from smartgen.engine.layout import KVLayout
from smartgen.engine.metrics import PathCounters
from smartgen.engine.planning import speculative_slice_size
from smartgen.engine.pool import PrefillStore
from smartgen.engine.prefill.gate import PushGate
from smartgen.engine.prefill.request import OpenedRequest, RequestGone
from smartgen.lanes.base import Completion, WriteOp
from smartgen.lanes.link import LinkEnd
from smartgen.lanes.thread_priority import lower_this_thread

__all__ = ["PrefillPath"]

log = logging.getLogger(__name__)


class PrefillPath:
    """Moves a prefill node's KV: stores each prefilled layer, pushes its planned blocks, pushes speculative slices
    (on idle notices, or chained), and answers fetches. What to push comes from `decide`; the link and failure
    control (`control.PrefillEngine`, which extends this class) opens, fails and frees requests."""

    def __init__(self, layout: KVLayout, max_store_bytes: int | None, flush_timeout_s: float) -> None:
        self.layout = layout
        self.flush_timeout_s = flush_timeout_s
        self.store = PrefillStore(layout, max_store_bytes)
        self.counters = PathCounters()  # KV bytes per path (masks and headers not counted)
        self.held_saved = PathCounters()  # per path: KV bytes not pushed because the decode node held them
        # per path: KV bytes a fetch sent that a push had sent already (still on the link when the step asked)
        self.crossed_twice = PathCounters()
        self.gate = PushGate()  # per link: speculation waits while pushes fill the room ahead (`gate`)
        self._requests: dict[str, OpenedRequest] = {}
        self._lock = threading.Lock()
        self._packer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quant-pack")  # quant2's layers, in order
        # plans and posts every speculative slice (an idle notice's, `push_speculative`, and a chained one's,
        # `_chain`), off the thread that serves fetches: planning a slice of scattered tokens takes milliseconds
        # that a fetch must not queue behind. The lock keeps direct calls (tests, tools) and this thread apart.
        self._speculation = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="speculation", initializer=lower_this_thread
        )
        self._spec_lock = threading.RLock()
        self._hint_lock = threading.Lock()  # hint queues: filled by the serving thread, taken by speculation

    def fail(self, request_id: str, reason: str) -> None:
        raise NotImplementedError  # the control's: it tells the decode node why and frees the request

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
        if request.flags.quantized:  # packed off the prefill thread, in layer order (one packer)
            self._packer.submit(self._push_quantized, request, layer)
            return 0
        caught_up = 0
        if request.deferred_plan is not None and self._prompt_waiting():
            caught_up = self._undefer(request, layer)
        blocks = decide.proactive_blocks(
            request.flags,
            request.plan.proactive_blocks(layer),
            layer,
            request.length,
            request.plan.num_blocks,
            token_scores=token_scores,
            held_prefix=request.held_prefix,
        )
        if request.sent is None:
            request.sent = torch.zeros_like(request.plan.proactive)
        request.sent[layer, blocks] = True
        return caught_up + self._push(request, [(layer, blocks)], tag="proactive")

    def _prompt_waiting(self) -> bool:
        """Whether another prompt waits for prefill (the control side knows its queue)."""
        return False

    def _undefer(self, request: OpenedRequest, layer: int) -> int:
        """A prompt arrived while `request`, whose K_r was deferred to a head start, prefills: no head start will
        follow, so its plan from before stands again, and the blocks it holds in layers prefilled already (before
        `layer`) go now, proactively. Returns the bytes posted."""
        assert request.deferred_plan is not None
        request.plan, request.deferred_plan = request.deferred_plan, None
        if request.sent is None:
            request.sent = torch.zeros_like(request.plan.proactive)
        late = []
        for earlier in range(layer):
            blocks = request.plan.proactive_blocks(earlier)
            blocks = blocks[~request.sent[earlier, blocks]]
            if blocks.numel():
                request.sent[earlier, blocks] = True
                late.append((earlier, blocks))
        return self._push(request, late, tag="proactive") if late else 0

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
        self,
        request_id: str,
        first_token: int,
        metadata: list[dict[str, torch.Tensor]] | None = None,
        *,
        forecast: bool = False,
    ) -> None:
        """FIRST_TOKEN, carrying the selector metadata the decode node needs before its first step; `forecast`: it
        promises a FORECAST (`send_forecast`), which the decode node waits for.

        Under a policy that drops remote entries (proactive-only) what the decode node attends must
        not depend on thread timing, so the proactive set lands before FIRST_TOKEN leaves.
        """
        request = self._get(request_id)
        if request is None:
            raise RequestGone(f"request {request_id!r} is not open on this prefill node")
        if request.flags.drop_remote and not request.link.push.flush(timeout=self.flush_timeout_s):
            raise TimeoutError(f"the proactive set of {request_id} did not land within {self.flush_timeout_s:g} s")
        metadata = None if request.resumed else metadata  # a resumed request's decode node kept its metadata
        cached = request.prefix_hit.tokens if request.prefix_hit is not None else 0
        packed = msg.pack_metadata(metadata or [])
        message = msg.FirstToken(request_id, int(first_token), packed, cached, forecast).pack()
        request.link.control.send(message, tag="metadata")
        self.counters.add("metadata", message.payload_bytes)

    def send_forecast(
        self,
        request_id: str,
        queries: dict[int, torch.Tensor],
        second: msg.SecondToken | None = None,
        *,
        step: int = 1,
    ) -> int:
        """FORECAST: the first decode step's query per sparse layer (`PrefillRunner.forecast`), and with `second` that
        step's token and the first token's K/V, right behind FIRST_TOKEN on the control lane; `step=2`: the queries
        of the step after it (`PrefillRunner.forecast_next`), which a FORECAST with `second` promised. Returns the
        bytes sent; 0 when the request has gone meanwhile."""
        request = self._get(request_id)
        if request is None:
            return 0
        if step == 2:  # the end of any head start: the decode node's own steps (and notices) take over
            request.heading = False
        if second is not None:
            dtype = self.layout.dtype  # the pool's: what the decode node would have computed and kept
            second = msg.SecondToken(second.token, second.keys.to(dtype), second.values.to(dtype))
        message = msg.Forecast(request_id, queries, second, step).pack()
        request.link.control.send(message, tag="metadata")
        self.counters.add("metadata", message.payload_bytes)
        return message.payload_bytes

    def push_speculative(self, request: OpenedRequest) -> int:
        """Pushes the next slice of unsent blocks, most important first; 0 if one is still in flight. Called on
        every idle notice; the slice is what the link moves in the time since the last one."""
        with self._spec_lock:
            now = time.monotonic()
            window = now - request.last_idle if request.last_idle is not None else 0.0
            request.last_idle = now
            fetched, request.fetched_since_idle = request.fetched_since_idle, 0
            return self._push_next_slice(request, window, fetched)

    def note_head_step(self, request_id: str) -> None:
        """A head-start step is about to run (Policy.head_start): its decode node runs no steps meanwhile and so sends
        no idle notices, so each such step stands for one and speculation goes on, chained or not."""
        request = self._get(request_id)
        if request is not None:
            request.heading = True
            if request.flags.speculative:
                self._submit_speculation(self._speculate_on_notice, request)

    def _chain(self, request: OpenedRequest) -> None:
        """A speculative slice landed: push the next one now, sized to CHAIN_WINDOW_S of link, rather than wait
        for the next idle notice. The decode node sends none while its fetches are on the link, and the link
        went idle in between (16-layer sample: link% 64 with notices alone, 68-88 chained). Fetches lose nothing:
        the pacer makes a bulk lane hold back while an on-demand reply is queued (`Pacer.urgent_enqueued`)."""
        with self._spec_lock:
            if self._get(request.request_id) is not request or request.last_idle is None:
                return  # released (all local, or aborted), or not decoding yet
            try:
                self._push_next_slice(request, decide.CHAIN_WINDOW_S, 0)
            except Exception:  # a broken link fails the request elsewhere; the chain just stops
                log.debug("prefill: chained speculation for %s stopped", request.request_id, exc_info=True)

    def _push_next_slice(self, request: OpenedRequest, window: float, fetched: int) -> int:
        if not request.flags.speculative or request.speculation_done:
            self.gate.drop(id(request.link), request.request_id)
            return 0
        if request.spec_in_flight is not None and not request.spec_in_flight.done():
            return 0
        if request.kv.layers_ready < self.layout.num_layers:
            return 0  # speculation starts once prefill is over
        if not request.flags.schedule:
            return self._post_slice(request, window, fetched)
        if request.heading and self._decoding_behind(request):
            return 0  # its tokens wait for no link; theirs do (the next head-start step asks again)
        key = id(request.link)
        if not self.gate.try_speculate(key, request.request_id, request.link_rate):
            return 0  # pushes fill the link's room ahead: its turn comes as one lands (`_hand_on`)
        if request.flags.chain:  # chained slices keep the link busy: a notice's window is not idle link time
            window = min(window, self.gate.ahead_s)
        sent = self._post_slice(request, window, fetched)
        if not sent and self.gate.next_waiting(key, request.link_rate) is not None:
            self._submit_speculation(lambda _: self._hand_on(request.link), request)  # no landing will hand on
        return sent

    def _post_slice(self, request: OpenedRequest, window: float, fetched: int) -> int:
        if request.hint_queue and request.unsent is not None:
            hinted = self._take_hinted(request, window, fetched)
            if hinted is not None:
                return hinted
        plan = request.plan
        next_slice = decide.next_slice(
            request.speculative_order()[request.spec_cursor :],
            size=speculative_slice_size(plan.num_layers * plan.num_blocks, request.flags.speculative_ratio),
            num_blocks=plan.num_blocks,
            # blocks on-demand fetches already brought whole are passed over, not resent
            pending=None
            if request.unsent is None
            else decide.block_pending(request.unsent, request.length, self.layout.num_blocks),
            link_rate=request.link_rate,
            window=window,
            fetched=fetched,
            token_bytes=self.layout.token_bytes,
        )
        if next_slice is None:
            return 0  # the window's link time went to fetches: nothing is idle to speculate with
        request.spec_cursor += next_slice.advance
        if not next_slice.ids.numel():
            return 0
        if self._by_entries(request):
            entries = block_entries(
                request.length, self.layout.num_blocks, plan.num_blocks, next_slice.ids, self.layout.num_kv_heads
            )
            return self._push_entries(request, entries)
        return self._push(request, next_slice.layer_blocks(), tag="speculative")

    def note_hints(self, request: OpenedRequest, hints: torch.Tensor) -> None:
        """Queues the entries an IDLE notice hinted at (flat ids (layer * length + token) * H + head: what the decode
        node's selector ranked just past its budget); speculation pushes them, newest notice first, ahead of the
        plan's order (`push_speculative`)."""
        if not request.flags.speculative or not hints.numel():
            return
        length, num_layers, num_heads = request.length, self.layout.num_layers, self.layout.num_kv_heads
        if int(hints.min()) < 0 or int(hints.max()) >= num_layers * length * num_heads:
            shape = f"{num_layers} x {length} x {num_heads}"
            raise msg.MessageError(f"IDLE: hints outside the {shape} prompt entries of {request.request_id!r}")
        with self._hint_lock:  # the speculation thread takes from the queue meanwhile
            request.hint_queue.append(hints)
            del request.hint_queue[: -decide.MAX_HINT_NOTICES]

    def _take_hinted(self, request: OpenedRequest, window: float, fetched: int) -> int | None:
        """Pushes hinted entries still unsent, newest notice first, as many as one idle window of the link moves
        (`decide.hint_room`, `decide.take_hints`), each (token, head) alone; None when no hinted entry is left."""
        assert request.unsent is not None
        num_heads = self.layout.num_kv_heads
        room = decide.hint_room(self.layout.token_bytes // num_heads, request.link_rate, window, fetched)
        if room == 0:
            return 0  # the window went to fetches: nothing is idle to speculate with
        with self._hint_lock:
            ids, request.hint_queue[:] = decide.take_hints(request.hint_queue, request.unsent.view(-1), room)
        if not ids.numel():
            return None
        if self._by_entries(request):
            return self._push_entries(request, ids)
        layer_wants = decide.entry_wants(ids, self.layout.num_layers, request.length, num_heads)
        return self._push_tokens(request, layer_wants, tag="speculative")

    def _by_entries(self, request: OpenedRequest) -> bool:
        """Whether a speculative push is described from its entry ids alone (`_push_entries`): a per-head unsent
        mask, and a link too slow to bridge gaps (bridging merges runs a layer at a time, `_push_tokens`)."""
        unsent = request.unsent
        return (
            unsent is not None
            and unsent.dim() == 3
            and not decide.bridge_tokens(self.layout.token_bytes, request.link_rate)
        )

    def _push_entries(self, request: OpenedRequest, ids: torch.Tensor) -> int:
        """A speculative push of flat (token, head) entries `ids` ((layer * length + token) * H + head; any order,
        repeats allowed), those still unsent: the descriptors made from the ids themselves (`entry_write_ops`), the
        same as the per-layer walk of `_push_tokens` makes from them as wants, without a mask per layer. A hinted
        slice names a few entries in most layers: the walk's per-layer wants, sums and unsent updates were most of
        the prefill node's CPU for a slice."""
        unsent = request.unsent
        assert unsent is not None  # `_by_entries`
        ids = torch.unique(ids)  # sorted, distinct
        held_entries = 0
        if request.held_prefix:  # wanted, and held by the decode node's own prefix: counted as saved
            tokens = ids // self.layout.num_kv_heads % request.length
            held_entries = int((tokens < request.held_prefix).sum())
        ids = ids[unsent.view(-1)[ids]]
        ops, kv_bytes = entry_write_ops(request.geometry, request.kv, request.slot, ids)
        unsent.view(-1)[ids] = False
        return self._post_push(request, ops, kv_bytes, held_entries, "speculative")

    def _push(self, request: OpenedRequest, layer_blocks: list[tuple[int, torch.Tensor]], tag: str) -> int:
        return self._push_tokens(request, block_wants(request.length, request.geometry, layer_blocks), tag)

    def _push_tokens(self, request: OpenedRequest, layer_wants: list[tuple[int, torch.Tensor]], tag: str) -> int:
        bridge, resendable = self._bridge(request) if tag == "speculative" else (0, None)
        ops, kv_bytes = token_write_ops(
            request.geometry, request.kv, request.slot, layer_wants, request.unsent, bridge, resendable
        )
        held_entries, num_heads = 0, self.layout.num_kv_heads
        for layer, want in layer_wants:  # want: [n] tokens, or [n, H] (token, head) entries
            held_entries += int(want[: request.held_prefix].sum()) * (1 if want.dim() == 2 else num_heads)
            if request.unsent is not None:
                request.unsent[layer, want] = False
        return self._post_push(request, ops, kv_bytes, held_entries, tag)

    def _post_push(self, request: OpenedRequest, ops: list[WriteOp], kv_bytes: int, held_entries: int, tag: str) -> int:
        """Posts one push's descriptors on the request's push lane and books it: counters, the link's room ahead
        (`gate`), a proactive push's measure of the link rate, a speculative one's chaining. `held_entries`: wanted
        (token, head) entries the decode node's own prefix holds (never sent: counted as saved)."""
        path = decide.push_path(request.flags, tag)
        num_heads = self.layout.num_kv_heads
        if held_entries:
            self.held_saved.add(path, self.layout.kv_bytes(held_entries, num_layers=1) // num_heads)
        if not ops:
            return 0
        sources = {**request.kv.byte_views(), ONES_SOURCE: request.ones}
        # the lane's tag is the path: the link's timeline tells a full transfer's pushes from a chosen set's
        completion = request.link.push.post_writes(request.request_id, sources, ops, tag=path)
        with self._lock:
            request.pushes_in_flight += 1

        def settled(_: bool) -> None:
            with self._lock:
                request.pushes_in_flight -= 1

        completion.add_done_callback(settled)
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
        self._gate_push(request, completion, kv_bytes)
        if tag == "speculative":
            request.spec_in_flight = completion
            if request.flags.chain:

                def chain(applied: bool) -> None:
                    if applied:
                        self._submit_chain(request)

                completion.add_done_callback(chain)
        return kv_bytes

    def _gate_push(self, request: OpenedRequest, completion: Completion, kv_bytes: int) -> None:
        """Counts a posted push (any request's: proactive sets go first) against its link's room ahead (`gate`)
        until it lands or fails; the landing hands the room on to the requests waiting to speculate."""
        key = id(request.link)
        self.gate.posted(key, kv_bytes)

        def freed(_: bool) -> None:
            turn = self.gate.landed(key, kv_bytes, request.link_rate)
            if turn is not None:
                self._submit_speculation(lambda _r: self._hand_on(request.link), request)

        completion.add_done_callback(freed)

    def _hand_on(self, link: LinkEnd) -> None:
        """Room opened on `link`: the requests waiting there post their slices in turn while room lasts (on the
        speculation thread). One with nothing left to send leaves the queue and hands on to the next."""
        key = id(link)
        with self._spec_lock:
            for _ in range(len(self.gate.waiting(key))):
                head = self.gate.next_waiting(key, self._link_rate(link))
                if head is None:
                    return
                request = self._get(head)
                if request is None or request.link is not link:
                    self.gate.drop(key, head)
                    continue
                try:
                    if self._push_next_slice(request, decide.CHAIN_WINDOW_S, 0):
                        return  # its landing hands on again
                except Exception:  # a broken link fails the request elsewhere; the queue goes on
                    log.debug("prefill: speculation for %s stopped", head, exc_info=True)
                if head in self.gate.waiting(key):
                    return  # the room filled meanwhile (a proactive set posted): it keeps its turn
                self.gate.drop(key, head)

    def _decoding_behind(self, request: OpenedRequest) -> bool:
        """Whether another request on the same link is decoding on its decode node with KV left to push: while this
        node decodes `request` itself (a head start), that request's steps wait for the link and this one's do not,
        so its speculation goes first, and this one's cache crosses once theirs is sent (or when its head start
        ends: a prompt to prefill, or its tokens run out). In a burst of two on random:32 at 2K, the first request
        decoded its whole answer fetching while the head-started second's speculation took half the link."""
        return self._fetching_behind(request, lambda other: other.last_idle is not None)  # idle notices: decoding

    def _handed_on_behind(self, request: OpenedRequest) -> bool:
        """Whether another request on the same link has been prefilled and handed on to its decode node (not decoded
        here) with KV left to push: its steps fetch, and its speculation waits behind any proactive set."""
        return self._fetching_behind(request, lambda other: other.kv.layers_ready >= self.layout.num_layers)

    def _fetching_behind(self, request: OpenedRequest, since: Callable[[OpenedRequest], bool]) -> bool:
        """Whether another speculating request on `request`'s link, not decoded here, has KV left to push and is
        `since` (how far along it counts)."""
        with self._lock:
            return any(
                other is not request
                and other.link is request.link
                and other.flags.speculative
                and since(other)
                and not other.heading
                and not other.speculation_done
                for other in self._requests.values()
            )

    def _link_rate(self, link: LinkEnd) -> float:
        """The link's rate as its requests' proactive pushes measured it (the fastest measure; 0: none yet)."""
        with self._lock:
            return max((r.link_rate for r in self._requests.values() if r.link is link), default=0.0)

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

    def _bridge(self, request: OpenedRequest) -> decide.Bridge:
        """How this request's speculative runs bridge gaps of already-sent tokens (`decide.bridge`)."""
        token_bytes = self.layout.token_bytes
        return decide.bridge(token_bytes, request.link_rate, request.unsent, request.held_prefix, request.held)

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
            request.request_id, {"packed": packed, ONES_SOURCE: request.ones}, ops, tag="full"
        )
        posted = time.monotonic()

        def landed(applied: bool) -> None:
            if applied:
                self.counters.add_time("full", time.monotonic() - posted)

        completion.add_done_callback(landed)
        return packed.numel()

    def _asked_of(self, message: msg.Fetch | msg.Attend) -> OpenedRequest:
        """The open request a FETCH or an ATTEND asks entries of, once its layer, positions and heads check out."""
        request = self._get(message.request_id)
        if request is None:
            raise RequestGone(f"request {message.request_id!r} is not open on this prefill node")
        layer, positions, heads = message.layer, message.positions, message.heads
        what = message.KIND.name
        if not 0 <= layer < self.layout.num_layers:
            raise msg.MessageError(f"{what}: no layer {layer} in a {self.layout.num_layers}-layer model")
        if positions.numel() and not (0 <= int(positions.min()) and int(positions.max()) < request.length):
            raise msg.MessageError(
                f"{what}: positions outside the {request.length}-token prompt of {message.request_id!r}"
            )
        if request.kv.layers_ready <= layer:
            raise ValueError(f"layer {layer} of {message.request_id!r} is not prefilled yet")
        if heads is not None and tuple(heads.shape) != (positions.numel(), self.layout.num_kv_heads):
            raise msg.MessageError(f"{what}: heads must be [{positions.numel()}, {self.layout.num_kv_heads}] bool")
        return request

    def _serve_fetch(self, link: LinkEnd, message: msg.Fetch) -> None:
        request = self._asked_of(message)
        layer, positions, heads = message.layer, message.positions, message.heads
        k, v = request.kv.k[layer, positions], request.kv.v[layer, positions]  # [p, H, d]
        again = 0  # entries asked for that a push sent already: it was still on the link when the step asked
        if heads is None:  # every head of each token
            k, v = k.contiguous(), v.contiguous()
            if request.unsent is not None:
                again = int((~request.unsent[layer, positions]).sum())
                request.unsent[layer, positions] = False  # a speculative push will not send these again
        else:  # only the (token, head) entries asked for: [E, d], token-major
            k, v = k[heads], v[heads]
            if request.unsent is not None:
                sent = request.unsent[layer, positions]
                again = int((~sent[heads]).sum())
                sent[heads] = False
                request.unsent[layer, positions] = sent  # a push still sends a token while any head is unsent
        if again:
            self.crossed_twice.add(
                "on_demand", again * self.layout.kv_bytes(1, num_layers=1) // self.layout.num_kv_heads
            )
        reply = msg.FetchReply(message.request_id, message.fetch_id, k, v).pack()
        if message.low:  # a forecast's fetch: after every reply a running request's step waits for
            reply.priority = 1
        link.control.send(reply, tag="on_demand")
        self.counters.add("on_demand", reply.payload_bytes)
        request.fetched_since_idle += reply.payload_bytes

    def _serve_attend(self, link: LinkEnd, message: msg.Attend) -> None:
        """Attends to the asked entries with the decode step's query and sends the partial result: the entries stay
        here (a speculative push still sends them), only [Hq, d + 2] floats cross."""
        request = self._asked_of(message)
        num_heads = self.layout.num_kv_heads
        if message.query.shape[0] % num_heads:
            raise msg.MessageError(f"ATTEND: {message.query.shape[0]} query heads for {num_heads} KV heads")
        layer, positions, heads = message.layer, message.positions, message.heads
        k, v = request.kv.k[layer, positions][heads], request.kv.v[layer, positions][heads]  # [E, d], token-major
        head_of = torch.arange(num_heads).expand_as(heads)[heads]
        out, stats = partial_attention(
            message.query.to(k.device), k, v, head_of.to(k.device), num_heads, message.scale, message.softcap
        )
        reply = msg.AttendReply(message.request_id, message.fetch_id, out.cpu(), stats.cpu()).pack()
        link.control.send(reply, tag="on_demand")
        self.counters.add("on_demand", reply.payload_bytes)
        request.fetched_since_idle += reply.payload_bytes
