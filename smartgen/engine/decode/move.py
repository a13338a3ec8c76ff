"""The decode side's data path: the pool, fetches posted and landed, the selected KV assembled for attention."""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

import smartgen.engine.decode.decide as decide
from smartgen.engine import messages as msg
from smartgen.engine.decode.request import (
    Assembled,
    AttendAsk,
    DecodeRequest,
    LateFetch,
    LinkLost,
    RequestFailed,
)
from smartgen.engine.index_ops import IndexSplit, entry_status, gather_kv, gather_valid, split_reorder
from smartgen.engine.kernels import use_triton
from smartgen.engine.layout import DENSE_LAYERS, KVLayout
from smartgen.engine.mask import REMOTE
from smartgen.engine.metrics import PathCounters
from smartgen.engine.pool import DecodePool
from smartgen.engine.prefix_cache import PrefixCache
from smartgen.lanes.base import Landing
from smartgen.lanes.link import LinkEnd

__all__ = ["DecodePath", "fetch_message"]


def _kind_of(future: Future) -> str:
    return future.kind if isinstance(future, _KindFuture) else "step"


def _waited_for(done: set[Future], futures: list[Future]) -> str:
    """The kind of fetch a wait was for: of a reply that ended it, else (it timed out) of the first still out."""
    return _kind_of(next(iter(done)) if done else futures[0])


def _arrival_of(future: Future) -> float:
    """When a done fetch's reply arrived (now, for a future that does not say)."""
    arrived = future.arrived if isinstance(future, _KindFuture) else None
    return time.monotonic() if arrived is None else arrived


def fetch_message(request_id: str, layer: int, fetch_id: int, entries: torch.Tensor, num_heads: int) -> msg.Fetch:
    """FETCH for flat (token, head) ids token * H + head, sorted: positions and the [T, H] heads wanted."""
    positions, token_of = torch.unique_consecutive(entries // num_heads, return_inverse=True)
    heads = torch.zeros(positions.numel(), num_heads, dtype=torch.bool)
    heads[token_of, entries % num_heads] = True
    return msg.Fetch(request_id, layer, fetch_id, positions, heads)


def _let_senders_run() -> None:
    """Gives the CPU up once after posting FETCHes, so the lane's send thread frames them now rather than when this
    thread next blocks: on a node whose threads share one core, the step's own work (the local gather) otherwise ran
    first and each fetch left ~0.4 ms later. With cores to spare it costs a system call."""
    if hasattr(os, "sched_yield"):
        os.sched_yield()  # releases the GIL too, so a send thread woken by the post takes it


class _KindFuture(Future):
    """A fetch's future, knowing what kind of fetch it is (`metrics.FETCH_KINDS`) and when its reply arrived: a
    prefetch's reply may wait a layer or more before the step lands it, and timing it to the landing counted that
    wait as the link's."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.arrived: float | None = None

    def set_result(self, result: object) -> None:
        self.arrived = time.monotonic()
        super().set_result(result)

    def set_exception(self, exception: BaseException | None) -> None:
        self.arrived = time.monotonic()
        super().set_exception(exception)


class DecodePath:
    """Moves a decode node's KV: owns the pool, posts fetches and lands their replies, gathers what a step selected.

    Each step's decisions come from `decide`; what fails a request on the way is marked on it by the link and
    failure control (`control.DecodeEngine`, which extends this class) through `_fail_request`.
    """

    recompute: bool  # a prefill node lost: its requests are opened again elsewhere (set by the control)

    def __init__(
        self,
        layout: KVLayout,
        num_slots: int,
        max_tokens: int,
        *,
        device: str,
        staged: bool,
        quantized: bool,
        prefix_cache: PrefixCache | None,
        fetch_timeout: float,
        stall_timeout: float | None,
        step_share: bool = True,
    ) -> None:
        self.layout = layout
        self.prefix_cache = prefix_cache or PrefixCache(0)
        self.held_bytes = 0  # KV bytes the prefix cache supplied instead of the link
        self.pool = DecodePool(layout, num_slots, max_tokens, device=device, staged=staged, quantized=quantized)
        self.counters = PathCounters()
        self.fetch_timeout = fetch_timeout  # seconds one step waits for a fetch before failing that request
        self.stall_timeout = stall_timeout
        self.link_wait_s = 0.0  # the step thread's waits for the link so far (fetch replies, layers 0-1's push)
        self.share_steps = step_share
        # the last decode step's own time (its wall less its link waits, `note_step`): a member of a batch of B holds
        # a step for its fetches at most a B-th of it (`step_share`)
        self.step_own_s: float | None = None
        self._requests: dict[str, DecodeRequest] = {}
        self._fetches: dict[int, tuple[Future, LinkEnd]] = {}  # fetch id -> its reply's future, the link it went on
        self._fetch_ids = itertools.count()
        self._lock = threading.Lock()
        regions = self.pool.byte_views()
        self._reply_regions = (regions["k"], regions["v"])  # where a lane that can lands fetch replies in place

    def _fail_request(self, request_id: str, reason: str, *, overloaded: bool = False, lost: bool = False) -> None:
        raise NotImplementedError  # the control's: it marks the request failed and wakes its waiters

    def _require_any(self, request_id: str) -> DecodeRequest:
        request = self._requests.get(request_id)
        if request is None:
            raise KeyError(f"unknown request {request_id!r}")
        return request

    def begin_layer(self, layer: int, request_ids: list[str]) -> None:
        """The start of an attention layer: tell prefill nodes the link is idle (speculative policies), with the
        hints gathered since the last notice; when, `decide.plan_notice` says (not in a request's first step,
        nor with a fetch on the link, and every CHAINED_NOTICE_LAYERS layers for a chaining policy)."""
        for request_id in request_ids:
            request = self._require_any(request_id)
            notice = decide.plan_notice(
                request.flags,
                live=request.live,
                first_step=request.metrics.in_first_step,
                fetch_in_flight=any(not future.done() for _, _, future, _ in request.late),
                layers_since_notice=request.layers_since_notice,
            )
            request.layers_since_notice = notice.layers_since_notice
            if notice.send:
                hinted = self._hinted(request)
                if hinted is not None:
                    if request.hinted_sent is None:
                        size = self.layout.num_layers * request.length * self.layout.num_kv_heads
                        request.hinted_sent = torch.zeros(size, dtype=torch.bool)
                    request.hinted_sent[hinted] = True
                request.link.control.send(msg.Idle(request_id, layer, hinted).pack())

    def hint_factor(self, request_ids: list[str], layer: int | None = None) -> float:
        """The widest hint ratio among these requests' policies (0: none hints). A request whose KV is all local
        hints nothing: the wider ranking and its mask lookups would cost step time for nothing; with `layer`, nor
        does one whose KV of that layer is all local (there is nothing left to push ahead there)."""
        return max(
            (
                ratio
                for r in map(self._require_any, request_ids)
                if (ratio := decide.hint_ratio(r.flags, released=r.released))
                and (layer is None or self._has_remote(r, layer))
            ),
            default=0.0,
        )

    def _has_remote(self, request: DecodeRequest, layer: int) -> bool:
        """Whether any (token, head) entry of the request's prompt in `layer` is still remote. Asked two or three
        times for every layer of every step (hints, prefetch), so every layer is scanned in one pass at the
        step's first ask and the answer kept for the step (`end_step` drops it). A kept answer can only be stale
        the safe way: nothing turns a LOCAL entry back to REMOTE while the request holds its slot, so a layer that
        lands meanwhile costs at most a selector pass that fetches nothing. One scan per layer and ask cost ~40 us
        (2.5 ms a step on 32 layers in a py-spy profile); the pass over all layers costs about one of them. The pass
        reads each layer from its local prefix on (`MaskTable.spans_local`), so it costs what landed since, not the
        context: a prompt token is REMOTE until it turns LOCAL, so "not all local" is "some remote"."""
        if request.remote_layers is None:
            local = self.pool.masks.spans_local(range(self.layout.num_layers), request.slot, 0, request.length)
            request.remote_layers = [not whole for whole in local]
        return request.remote_layers[layer]

    def hint(self, layer: int, request_ids: list[str], wide: torch.Tensor) -> None:
        """Notes, for the next IDLE, the prompt entries of one layer that a wider selection (the selector at
        (1 + hints) x its budget) picks past the layer's own (`wide` [B·H, k'], `Selector.select_with_next`): what
        the selector is likely to pick next. Only requests whose policy hints. Each request keeps a view of its rows;
        the next notice reads which are still remote in some head, every noted layer at once (`_hinted`): a status
        read per layer cost the step thread about 7 ms a step on 32 layers (random:32, 2K tokens, most of the KV
        still remote), a few tensor operations each."""
        num_heads = self.layout.num_kv_heads
        for b, request_id in enumerate(request_ids):
            request = self._require_any(request_id)
            if request.flags.hints and request.live:
                request.hints.append((layer, wide[b * num_heads : (b + 1) * num_heads]))
                if len(request.hints) > 2 * self.layout.num_layers:  # no notice for a while: keep its size bounded
                    request.hints_kept = self._hinted(request)

    def hint_entries(self, request: DecodeRequest, layer: int, entries: torch.Tensor) -> None:
        """Names remote (token, head) entries of one layer (flat ids token * H + head) on the request's next idle
        notice, after what its selections note there: for a policy with hints, the speculative push sends them
        next. Picks attended where they are, and a forecast's for a request that attends to its misses in place."""
        if not (request.flags.hints and request.live) or not entries.numel():
            return
        ids = entries.cpu() + layer * request.length * self.layout.num_kv_heads
        kept = request.hints_kept
        request.hints_kept = ids if kept is None else torch.cat([kept, ids])

    def _hinted(self, request: DecodeRequest) -> torch.Tensor | None:
        """The request's noted hints still remote, as distinct (layer, token, head) entries; the notes are cleared."""
        noted, kept = request.hints, request.hints_kept
        request.hints, request.hints_kept = [], None
        if not noted:
            return kept
        return decide.hinted(noted, self.pool.masks.values, request.slot, request.length, kept)

    def assemble(
        self,
        layer: int,
        request_ids: list[str],
        index: torch.Tensor,
        timeout: float | None = None,
        attend: AttendAsk | None = None,
    ) -> Assembled:
        """Gathers the selected KV of one layer: index [B·H, k] -> K, V [B·H, k, d], remote-first rows.

        Every policy decision is the request's own, never the batch's: a drop-remote request's
        remote entries turn into padding while its neighbours' are fetched, and a parallel
        request gathers its local entries while the fetches are in flight, a sequential one after.
        A fetch that fails or outlasts `timeout` (default: the engine's fetch_timeout) fails its own
        request only (marked, not raised): the layer is assembled for the rest of the batch.
        With `attend` (the step's query), a request whose policy attends to remote entries in place sends them
        with its query (ATTEND) instead of fetching them: its rows hold only what is local, and the replies'
        futures come back in `Assembled.attended` for `land_attended`.
        """
        requests = [self._require_any(rid) for rid in request_ids]
        self._land_late(requests)
        self.pool.sync_staged(layer, [r.slot for r in requests])
        if layer < DENSE_LAYERS:  # a request that attends to misses in place does not wait for the push
            waiting = [r for r in requests if not self._attends(r, attend)]
            self._await_pushed(layer, waiting, self.fetch_timeout if timeout is None else timeout)
        num_heads = self.layout.num_kv_heads
        slots = torch.tensor([r.slot for r in requests], dtype=torch.int64, device=index.device)
        # a layer whose prompt KV has all landed for every request (full transfer's, and SmartGen's once whole) is
        # split without reading the mask; `_has_remote` scans each request once a step and is never wrongly False.
        # Off CUDA only: there the split kernel's one pass is cheaper than the scan's read of the masks
        lengths = None
        if not use_triton(index) and not any(self._has_remote(r, layer) for r in requests):
            lengths = torch.tensor([self.pool.lengths[r.slot] for r in requests], device=index.device)
            lengths = lengths.repeat_interleave(num_heads)
        split = split_reorder(index, self.pool.masks.layer(layer).to(index.device), slots, num_heads, lengths)
        # a request this step already gave up on waits for nothing more: its rows are assembled from what is local;
        # one held back for its share has its picks here fetched for its redo (`_fetch_ahead`), a parked one not
        self._fetch_ahead(layer, requests, split)
        attended, attended_of = self._send_attends(layer, requests, split, attend)
        plan = decide.plan_assembly(
            split,
            drop=[r.flags.drop_remote or r.deferred or b in attended_of for b, r in enumerate(requests)],
            parallel=[r.flags.parallel for r in requests],
        )
        split, num_remote, local_stop, early_stop = plan.split, plan.split.num_remote, plan.num_valid, plan.early_stop
        num_rows, k = index.shape
        shape = (num_rows, k, self.layout.head_dim)
        # one host read decides which requests fetch (a read per request and layer cost a sync each on a GPU)
        remote_of = num_remote.view(len(requests), num_heads).sum(1).tolist()
        fetches = self._send_fetches(layer, requests, split, remote_of)
        if fetches:
            _let_senders_run()
        # local entries of parallel requests now, while their fetches are in flight; the others' after landing
        started = time.monotonic()
        k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]
        # one gather when every request gathers early, or when nothing is remote (a sequential policy's layer that
        # fetches nothing, full transfer's every layer): two calls into zeroed outputs cost about twice as much
        one_gather = plan.all_parallel or not any(remote_of)
        if one_gather:
            # every valid entry in one gather, the remote ones too: whatever they read is overwritten once their
            # fetch lands (below), and the padding is zeroed
            k_out = torch.empty(shape, dtype=self.layout.dtype, device=self.pool.k.device)
            v_out = torch.empty_like(k_out)
            gather_valid(k_pool, v_pool, slots, split.index, local_stop, k_out, v_out)
        else:
            k_out = torch.zeros(shape, dtype=self.layout.dtype, device=self.pool.k.device)
            v_out = torch.zeros_like(k_out)
            gather_kv(k_pool, v_pool, slots, split.index, num_remote, early_stop, k_out, v_out)
        early_s = time.monotonic() - started
        waited = time.monotonic()
        self._land_fetches(layer, requests, fetches, self.fetch_timeout if timeout is None else timeout)
        self.link_wait_s += time.monotonic() - waited
        late_s = 0.0
        if not one_gather:
            local_started = time.monotonic()
            gather_kv(k_pool, v_pool, slots, split.index, early_stop, local_stop, k_out, v_out)
            late_s = time.monotonic() - local_started
        if fetches:
            zeros = torch.zeros_like(num_remote)
            gather_kv(k_pool, v_pool, slots, split.index, zeros, num_remote, k_out, v_out)
        # the layer's counts per request in one host read: selected, dropped, gathered early, gathered late
        counts = torch.stack([local_stop, plan.dropped, early_stop - num_remote, local_stop - early_stop])
        selected_of, dropped_of, early_of, late_of = counts.view(4, len(requests), num_heads).sum(2).tolist()
        entry_bytes = 2 * k_out.shape[-1] * k_out.element_size()  # K and V of one token in one head
        if one_gather:
            self.counters.add("local", (sum(early_of) + sum(late_of)) * entry_bytes, early_s)
        else:
            self.counters.add("local", sum(early_of) * entry_bytes, early_s)
            self.counters.add("local", sum(late_of) * entry_bytes, late_s)
        selected = remote = 0
        for b, request in enumerate(requests):
            if request.deferred:
                continue  # its step is redone: counted then
            row_selected, row_remote, row_dropped = selected_of[b], remote_of[b], dropped_of[b]
            if b in attended_of:  # attended where they are: selected and remote, not dropped
                row_selected, row_remote, row_dropped = row_selected + attended_of[b], attended_of[b], 0
            request.metrics.count_selection(row_selected, row_remote, layer, row_dropped)
            if row_remote:
                request.remote_met.add(layer)
            if layer >= DENSE_LAYERS:  # layers 0-1 move whole whatever is selected: the bound counts them apart
                request.step_selections.append((layer, split.index[b * num_heads : (b + 1) * num_heads]))
            selected += row_selected
            remote += row_remote
        self.counters.add_selection(selected, remote)
        return Assembled(k_out, v_out, local_stop, split, attended)

    def _send_attends(
        self, layer: int, requests: list[DecodeRequest], split: IndexSplit, attend: AttendAsk | None
    ) -> tuple[list[tuple[int, Future, float]], dict[int, int]]:
        """ATTEND for each request whose policy attends to remote entries in place and that has some in this layer
        (`_attends`): its remote (token, head) entries with its rows of the step's query; layers 0-1 too (a joiner
        steps before their push has landed). Returns ([(b, future, sent)], {b: entries asked})."""
        asking = [b for b, r in enumerate(requests) if self._attends(r, attend)]
        if attend is None or not asking:
            return [], {}
        num_heads = self.layout.num_kv_heads
        remote_of = split.num_remote.view(len(requests), num_heads).sum(1).tolist()
        attended: list[tuple[int, Future, float]] = []
        asked: dict[int, int] = {}
        for b in asking:
            if not remote_of[b]:
                continue
            request, rows = requests[b], slice(b * num_heads, (b + 1) * num_heads)
            entries = decide.remote_entries(split.index[rows], split.status[rows])
            if request.metrics.in_first_step:
                request.metrics.first_step_unforeseen += int(entries.numel())
            attended.append((b, self._send_attend(request, layer, entries, attend, b), time.monotonic()))
            asked[b] = int(entries.numel())
            request.metrics.step_attended += asked[b]
            # an entry attended where it stays remote, and each step that picks it again asks again: hinted, so the
            # speculative push brings it next (layers 0-1 are on their way whole)
            if layer >= DENSE_LAYERS:
                self.hint_entries(request, layer, entries)
        if attended:
            _let_senders_run()
        return attended, asked

    @staticmethod
    def _attends(request: DecodeRequest, attend: AttendAsk | None) -> bool:
        """Whether this step asks ATTENDs for the request's remote picks: its policy attends to them in place, the
        step brought its query, and it can ask now (live, its step not being redone)."""
        return (
            attend is not None
            and request.flags.attend_remote
            and request.live
            and not request.deferred
            and not request.held_back
            and not request.metrics.error
        )

    def _send_attend(
        self, request: DecodeRequest, layer: int, entries: torch.Tensor, attend: AttendAsk, b: int
    ) -> Future:
        """Sends one ATTEND for flat (token, head) ids of one layer with batch member b's query; its future gets the
        reply (or LinkLost)."""
        future, link, fetch_id = self._asked(request, "step")
        asked = fetch_message(request.request_id, layer, fetch_id, entries, self.layout.num_kv_heads)
        assert asked.heads is not None  # fetch_message names the heads of every token
        query = attend.query[b].detach().float().cpu()
        message = msg.Attend(request.request_id, layer, fetch_id, asked.positions, asked.heads, query, attend.scale)
        if attend.softcap is not None:
            message = dataclasses.replace(message, softcap=attend.softcap)
        link.control.send(message.pack(), tag="fetch_request")
        return future

    def land_attended(
        self,
        layer: int,
        request_ids: list[str],
        attended: list[tuple[int, Future, float]],
        timeout: float | None = None,
    ) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Waits for one layer's ATTEND replies (`Assembled.attended`): [(b, output [Hq, d], [Hq, 2] max and sum)]
        for each that came. One that fails or is not back `timeout` (default: the engine's fetch_timeout) after it
        was sent fails its request only (marked, as a failed fetch does): that request's rows keep the local part
        and it leaves after the step; a lost link under recompute has it redo the step elsewhere."""
        limit = self.fetch_timeout if timeout is None else timeout
        parts: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        started = time.monotonic()
        for b, future, sent in attended:
            request = self._require_any(request_ids[b])
            try:
                reply = self._reply_or_fail(request, future, max(0.0, sent + limit - time.monotonic()))
            except TimeoutError:
                self.counters.add_failure("on_demand")
                self._fail_request(request.request_id, f"attend for layer {layer} timed out after {limit:g} s")
                continue
            if reply is None:
                continue
            if not isinstance(reply, msg.AttendReply):
                self._fail_request(request.request_id, f"attend for layer {layer}: a {type(reply).__name__} came back")
                continue
            round_trip = max(0.0, _arrival_of(future) - sent)
            self.counters.add("on_demand", reply.num_bytes, round_trip)
            self.counters.add_fetch("step", round_trip)
            parts.append((b, reply.out, reply.stats))
        if attended:
            elapsed = time.monotonic() - started
            self.link_wait_s += elapsed
            self.counters.add_fetch_wait("step", elapsed)
            for b in {b for b, _, _ in attended}:
                self._require_any(request_ids[b]).metrics.count_fetch_wait(elapsed)
        return parts

    def _await_pushed(self, layer: int, requests: list[DecodeRequest], timeout: float) -> None:
        """Layers 0-1 are pushed whole for every request: while that push is on its way, fetching the layer would
        send its bytes twice (a push's masks turn local only once all its data is in, so every token still looks
        remote). Waits for the push instead, up to `stall_timeout` (else `timeout`); what is still remote after
        that is fetched."""
        limit = min(timeout, self.stall_timeout) if self.stall_timeout is not None else timeout
        deadline = time.monotonic() + limit
        masks = self.pool.masks
        for request in requests:
            waited = time.monotonic()
            while not masks.span_local(layer, request.slot, 0, request.length):  # every token, every head
                if request.metrics.error or request.deferred or time.monotonic() > deadline:
                    break
                time.sleep(0.0002)
                self.pool.sync_staged(layer, [request.slot])
            elapsed = time.monotonic() - waited
            request.metrics.count_fetch_wait(elapsed)  # the link's time, as a fetch's would be
            self.link_wait_s += elapsed

    def count_step_selections(self, request: DecodeRequest) -> None:
        """Counts the selections of the step just ended (`RequestMetrics.selection_counts`) and the bytes of the
        entries no earlier step selected (the bound's `selected_union_bytes`). Once a step, not once a layer: the
        step's selecting layers share one index width, so they are counted in a few tensor operations, and never
        while a layer waits for them."""
        pending, request.step_selections = request.step_selections, []
        if not pending:
            return
        counts = request.metrics.selection_counts
        length, num_heads = request.length, self.layout.num_kv_heads
        if counts is None:
            shape = (self.layout.num_layers, length, num_heads)
            counts = request.metrics.selection_counts = torch.zeros(shape, dtype=torch.int32)
        # flat ids (layer * n + token) * H + head into the [L * n * H] counts: a 1-D read and add (a 2-D advanced
        # index cost ~1 ms a layer at 32K tokens: 26K entries)
        by_width: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for layer, rows in pending:
            by_width.setdefault(rows.shape[1], []).append((layer, rows))
        flats = []
        for group in by_width.values():
            rows = torch.stack([r for _, r in group]).cpu()  # [L', H, k]
            layers = torch.tensor([layer for layer, _ in group], dtype=torch.int64).view(-1, 1, 1)
            valid = (rows >= 0) & (rows < length)
            heads = torch.arange(num_heads).view(1, -1, 1)
            flats.append(((layers * length + rows) * num_heads + heads)[valid])
        flat = flats[0] if len(flats) == 1 else torch.cat(flats)
        seen = counts.view(-1)
        new = int((seen.index_select(0, flat) == 0).sum())
        seen.index_add_(0, flat, torch.ones(flat.numel(), dtype=torch.int32))
        request.metrics.count_new_selection(new * 2 * self.layout.head_dim * self.layout.dtype.itemsize)

    def local_spans(
        self, layer: int, request_ids: list[str], starts: list[int], stops: list[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Fast path for dense and sliding-window layers: views of tokens [start_b, stop_b) of each request.

        Returns K and V views ([n_b, H, d], no copy) when every one of those tokens is local,
        else None (use `assemble`, which fetches what is missing).
        """
        requests = [self._require_any(rid) for rid in request_ids]
        self.pool.sync_staged(layer, [r.slot for r in requests])
        masks = self.pool.masks
        for request, start, stop in zip(requests, starts, stops):
            if stop > start and not masks.span_local(layer, request.slot, start, stop):
                return None
        spans = []
        heads = self.layout.num_kv_heads
        for request, start, stop in zip(requests, starts, stops):
            spans.append((self.pool.k[layer, request.slot, start:stop], self.pool.v[layer, request.slot, start:stop]))
            request.metrics.count_selection(heads * (stop - start), 0, layer)
        self.counters.add_selection(heads * sum(stop - start for start, stop in zip(starts, stops)), 0)
        return spans

    def _send_fetches(
        self, layer: int, requests: list[DecodeRequest], split: IndexSplit, remote_of: list[int]
    ) -> list[tuple[DecodeRequest, torch.Tensor, Future, float]]:
        """FETCH for every request with remote entries (`remote_of[b]`: request b's count): exactly its remote
        (token, KV head) entries, as flat ids token * H + head (a head no query of the step selected is not
        moved)."""
        num_heads = self.layout.num_kv_heads
        fetches = []
        for b, request in enumerate(requests):
            rows = slice(b * num_heads, (b + 1) * num_heads)
            if not remote_of[b] or request.metrics.error:
                continue  # a failed request's rows are assembled from what is local; it leaves after the step
            if request.resuming:  # nothing to fetch from until its new prefill node has prefilled: park it
                request.deferred = True
                continue
            in_flight = [entry for entry in request.late if entry[0] == layer]
            if in_flight:  # a redone step waits for what an earlier try asked for instead of asking again
                request.late = [entry for entry in request.late if entry[0] != layer]
                fetches += [(request, asked, fut, sent) for _, asked, fut, sent in in_flight]
            entries = decide.remote_entries(split.index[rows], split.status[rows], [e[1] for e in in_flight])
            if request.metrics.in_first_step and layer >= DENSE_LAYERS:
                request.metrics.first_step_unforeseen += int(entries.numel())
            if entries.numel():
                fetches.append((request, entries, self._send_fetch(request, layer, entries), time.monotonic()))
                request.metrics.step_fetched += int(entries.numel())
                if request.hinted_sent is not None:  # one read: which of these entries a notice named earlier
                    ids = entries + layer * request.length * num_heads
                    request.metrics.step_fetched_hinted += int(request.hinted_sent[ids].sum())
        return fetches

    def _send_fetch(self, request: DecodeRequest, layer: int, entries: torch.Tensor, kind: str = "step") -> Future:
        """Sends one FETCH for flat (token, head) ids of one layer; its future gets the reply (or LinkLost). `kind`
        (`metrics.FETCH_KINDS`) is what its landing is counted as; a forecast's reply goes after the replies to
        other fetches queued at the prefill node."""
        # a forecast's reply, and for a request that attends to misses in place a prefetch's (the step no longer
        # waits for it: it asks an ATTEND), go after the replies a step waits for
        low = kind == "forecast" or (kind == "prefetch" and request.flags.attend_remote)
        future, link, fetch_id = self._asked(request, kind)
        fetch = fetch_message(request.request_id, layer, fetch_id, entries, self.layout.num_kv_heads)
        if low:
            fetch = dataclasses.replace(fetch, low=True)
        landing = self._landing(request, layer, entries) if link.control.lands_replies else None
        link.control.send(fetch.pack(), tag="fetch_request", landing=landing)
        return future

    def _asked(self, request: DecodeRequest, kind: str) -> tuple[_KindFuture, LinkEnd, int]:
        """A new ask's future (of `kind`), the link it goes on and its id, the reply's future registered under the id
        (failed at once with LinkLost when the link is down). The link is read once: a lost one may be swapped for
        another under us (recompute)."""
        future, link = _KindFuture(kind), request.link
        with self._lock:
            fetch_id = next(self._fetch_ids)
            self._fetches[fetch_id] = (future, link)
        if not link.alive:
            future.set_exception(LinkLost(f"prefill node connection lost: {link.error or 'connection closed'}"))
        return future, link, fetch_id

    def _landing(self, request: DecodeRequest, layer: int, entries: torch.Tensor) -> Landing:
        """Where a FETCH's reply belongs: its K rows, then its V rows (the reply's payload order)."""
        ranges = self.pool.geometry.entry_ranges(layer, request.slot, entries)
        k, v = self._reply_regions
        return Landing(request.request_id, [(k, o, n) for o, n in ranges] + [(v, o, n) for o, n in ranges])

    def prefetch_wanted(self, request_ids: list[str], layer: int | None = None) -> bool:
        """Whether any of these requests prefetches now (`prefetchers`)."""
        return bool(self.prefetchers(request_ids, layer))

    def prefetchers(self, request_ids: list[str], layer: int | None = None) -> list[int]:
        """The positions in `request_ids` of requests that prefetch now (`decide.prefetches`). With `layer` (the one
        to prefetch), only those with remote KV left in it whose last selection of it met some
        (`decide.prefetch_layer`): speculating a selection of a layer that is all local would cost the step a
        selector pass for no fetch, and the speculated selection is made for these requests only."""
        return [
            b
            for b, r in enumerate(map(self._require_any, request_ids))
            if decide.prefetches(r.flags, first_step=r.metrics.in_first_step, released=r.released)
            and (
                layer is None
                or decide.prefetch_layer(
                    layer, layer_has_remote=self._has_remote(r, layer), remote_met_before=r.remote_met_before
                )
            )
        ]

    def prefetch(self, layer: int, request_ids: list[str], index: torch.Tensor) -> None:
        """Fetches now the remote entries of a speculated index ([B·H, k], layer l+1's selection guessed while layer
        l computes), for requests whose policy prefetches. They are in flight like a stalled step's fetches
        (`late`): layer l+1's own selection waits for them instead of asking again, and fetches only the rest."""
        num_heads = self.layout.num_kv_heads
        requests = [self._require_any(rid) for rid in request_ids]
        slots = torch.tensor([r.slot for r in requests], dtype=torch.int64, device=index.device)
        self.pool.sync_staged(layer, [r.slot for r in requests])
        status = entry_status(index, self.pool.masks.layer(layer).to(index.device), slots, num_heads)
        sent = False
        for b, request in enumerate(requests):
            first_step, released = request.metrics.in_first_step, request.released
            if not (decide.prefetches(request.flags, first_step=first_step, released=released) and request.live):
                continue
            if request.deferred:
                continue
            rows = slice(b * num_heads, (b + 1) * num_heads)
            if not bool((status[rows] == REMOTE).any()):
                continue
            asked = self._ask_ahead(request, layer, index[rows], status[rows])
            if not asked:
                continue
            request.metrics.prefetched_entries += asked
            request.remote_met.add(layer)
            sent = True
        if sent:
            _let_senders_run()

    def note_step(self, own_s: float) -> None:
        """The decode step just run took `own_s` of its own (its wall less its link waits): the base of each
        member's share of the next (`step_share`)."""
        self.step_own_s = own_s

    def step_share(self, requests: list[DecodeRequest]) -> float | None:
        """How long, over a whole step, a batch of these requests waits for one member's fetches at most: that
        member's share of the step, the last step's own time over the batch size. None alone (a request alone holds
        no one up), before any step, or with `step_share` off."""
        if not self.share_steps or len(requests) < 2 or self.step_own_s is None:
            return None
        return self.step_own_s / len(requests)

    def _fetch_ahead(self, layer: int, requests: list[DecodeRequest], split: IndexSplit) -> None:
        """For each request this step held back for its share: fetches, at once and without waiting, the remote
        entries of its selection here (made from layers that attended to what was local: close to what its redo
        selects), so that the redo in the next step finds them in or on their way (`late`) rather than asking
        layer by layer, a round trip each."""
        num_heads = self.layout.num_kv_heads
        for b, request in enumerate(requests):
            if not request.held_back or request.flags.drop_remote or request.resuming or not request.live:
                continue
            rows = slice(b * num_heads, (b + 1) * num_heads)
            self._ask_ahead(request, layer, split.index[rows], split.status[rows])

    def _ask_ahead(self, request: DecodeRequest, layer: int, index: torch.Tensor, status: torch.Tensor) -> int:
        """Fetches the remote entries of one request's index rows of a layer ([H, k] and their status) not already
        asked for, at once and without waiting: the reply lands with `late`. Returns the entries asked."""
        asked = [entries for at, entries, _, _ in request.late if at == layer]
        entries = decide.remote_entries(index, status, asked)
        if entries.numel():
            request.late.append(
                (layer, entries, self._send_fetch(request, layer, entries, "prefetch"), time.monotonic())
            )
        return int(entries.numel())

    def _land_fetches(self, layer: int, requests: list[DecodeRequest], fetches: list, timeout: float) -> None:
        """Lands each fetch reply as it comes; a failure fails only its request.

        A request waits at most `timeout` from its fetch's sending (and its first late try) before it fails;
        with a `stall_timeout`, a fetch not back by then defers its request instead: the layer is assembled
        for the rest of the batch, the fetch lands when it arrives (`_land_late`), and the request parks outside
        the batch until it has. In a batch (`step_share`), each wait is shared out among the members whose fetches
        it waits for, and a member whose part over the step reaches its share is held back: deferred the same way,
        but it stays in the batch and redoes its step in the next. No member holds the others for longer than its
        own share of the step, and the last member not deferred is never held back (a step must move someone).
        """
        share = self.step_share(requests)
        pending: list[tuple[DecodeRequest, torch.Tensor, Future, float, float, float]] = []
        for request, entries, future, sent in fetches:
            if request.deferred:
                request.late.append((layer, entries, future, sent))
                continue
            first = request.deferred_since if request.deferred_since is not None else sent
            limit = first + timeout
            if self.stall_timeout is not None:
                limit = min(limit, sent + self.stall_timeout)
            pending.append((request, entries, future, sent, first, limit))
        while pending:
            now = time.monotonic()
            holders = list({id(p[0]): p[0] for p in pending}.values())
            deadline = min(p[5] for p in pending)
            # each holder is charged 1/len(holders) of the wait: the first to use up its share is held back then
            spent = [r.step_wait_s for r in holders if self._may_hold_back(r, requests)] if share is not None else []
            if share is not None and spent:
                deadline = min(deadline, now + max(0.0, share - max(spent)) * len(holders))
            futures = [p[2] for p in pending]
            done, _ = wait_futures(futures, timeout=max(0.0, deadline - now), return_when=FIRST_COMPLETED)
            elapsed = time.monotonic() - now
            self.counters.add_fetch_wait(_waited_for(done, futures), elapsed)
            for request in holders:
                request.metrics.count_fetch_wait(elapsed)
                request.step_wait_s += elapsed / len(holders)
            now = time.monotonic()
            still = []
            for request, entries, future, sent, first, limit in pending:
                if request.deferred:  # deferred at another of its fetches this layer: this one lands late too
                    request.late.append((layer, entries, future, sent))
                elif request.metrics.error:  # failed meanwhile (another fetch, its link): it leaves after the step
                    continue
                elif future.done():
                    self._land_one(request, layer, entries, future, sent)
                elif now >= limit:
                    if self.stall_timeout is not None and now - first < timeout:
                        self._defer(request, layer, entries, future, sent, first)
                        continue
                    self.counters.add_failure("on_demand")
                    self._fail_request(request.request_id, f"fetch for layer {layer} timed out after {timeout:g} s")
                elif share is not None and request.step_wait_s >= share and self._may_hold_back(request, requests):
                    request.held_back = True
                    self._defer(request, layer, entries, future, sent, first)
                else:
                    still.append((request, entries, future, sent, first, limit))
            pending = still

    def _may_hold_back(self, request: DecodeRequest, requests: list[DecodeRequest]) -> bool:
        """A batch member may be held back for its share: it can fetch again, and another member still steps."""
        if not request.live or request.resuming or request.metrics.error:
            return False
        return any(other is not request and not other.deferred and not other.metrics.error for other in requests)

    def _defer(
        self, request: DecodeRequest, layer: int, entries: torch.Tensor, future: Future, sent: float, first: float
    ) -> None:
        """The step goes on without this request's fetch: it lands when it arrives, the request's step is redone."""
        request.deferred = True
        request.deferred_since = first
        request.metrics.deferred_steps += 1
        self.counters.add_deferral("share" if request.held_back else "stall")
        request.late.append((layer, entries, future, sent))

    def _land_one(self, request: DecodeRequest, layer: int, entries: torch.Tensor, future: Future, sent: float) -> None:
        """Lands one fetch whose future is done: its reply, or the failure it carries (for its request only)."""
        reply = self._reply_or_fail(request, future)
        if reply is not None:
            self._land_reply(request, layer, entries, reply, sent, _kind_of(future), _arrival_of(future))

    def _reply_or_fail(self, request: DecodeRequest, future: Future, timeout: float | None = None) -> Any:
        """The reply a fetch's or an ATTEND's future holds (waiting up to `timeout`: TimeoutError past it); None when
        it carries a failure, marked on its request only: a lost link under recompute has it redo its step where
        it is opened again (or fail, when no node is left)."""
        try:
            return future.result(timeout=timeout)
        except LinkLost as exc:
            if self.recompute:
                request.deferred = True
            else:
                self._fail_request(request.request_id, str(exc), lost=True)
        except RequestFailed as exc:
            self._fail_request(request.request_id, str(exc))
        return None

    def _land_reply(
        self,
        request: DecodeRequest,
        layer: int,
        entries: torch.Tensor,
        reply: msg.FetchReply,
        sent: float,
        kind: str = "step",
        arrived: float | None = None,
    ) -> None:
        """Puts a fetch reply's K/V in the pool (or checks the lane put them there) and counts it; `arrived`: when
        the reply came (default now), so its round trip is the link's and the prefill node's, not the step's."""
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
        request.fetch_counts[layer].view(-1).index_add_(0, entries, torch.ones_like(entries, dtype=torch.int32))
        request.metrics.fetched_tokens += int(torch.unique_consecutive(entries // self.layout.num_kv_heads).numel())
        round_trip = max(0.0, (time.monotonic() if arrived is None else arrived) - sent)
        self.counters.add("on_demand", reply.num_bytes, round_trip)
        self.counters.add_fetch(kind, round_trip)

    def _land_late(self, requests: list[DecodeRequest]) -> None:
        """Lands the replies of fetches an earlier step gave up waiting for, as far as they have arrived."""
        for request in requests:
            waiting: list[LateFetch] = []
            for layer, entries, future, sent in request.late:
                if not future.done():
                    waiting.append((layer, entries, future, sent))
                    continue
                try:
                    reply = future.result()
                    self._land_reply(request, layer, entries, reply, sent, _kind_of(future), _arrival_of(future))
                except LinkLost as exc:
                    if not self.recompute:  # else asked again of the node it is opened on next
                        self._fail_request(request.request_id, str(exc), lost=True)
                except RequestFailed as exc:
                    self._fail_request(request.request_id, str(exc))
            request.late = waiting

    def append(self, layer: int, request_id: str, k: torch.Tensor, v: torch.Tensor) -> int:
        """Adds a generated token's K/V ([H, d]) for one layer; it is local at once."""
        return self.pool.append(layer, self._require_any(request_id).slot, k, v)

    def append_batch(self, layer: int, request_ids: list[str], k: torch.Tensor, v: torch.Tensor) -> None:
        """`append` for each request of a batch at once: K/V [B, H, d], row b request_ids[b]'s."""
        self.pool.append_batch(layer, [self._require_any(rid).slot for rid in request_ids], k, v)
