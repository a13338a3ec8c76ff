"""One link shared by many requests: speculation waits behind proactive sets, in turn, and a fetch trims what waits."""

import threading
import time
from contextlib import contextmanager

import pytest
import torch
from test_engine import LAYOUT, _engines, _prefilled, _wait, config

import smartgen.engine.prefill as prefill_module
from smartgen.apps.simulate import calibrate
from smartgen.apps.synthetic import SyntheticTrace, synthetic_kv
from smartgen.engine.layout import block_bounds
from smartgen.engine.planning import Planner, defer_proactive
from smartgen.engine.policy import get_policy
from smartgen.engine.prefill.gate import PushGate
from smartgen.lanes.base import Completion


@pytest.fixture(scope="module")
def importance():
    cfg = config()
    return calibrate(cfg, SyntheticTrace(LAYOUT.num_layers, LAYOUT.num_kv_heads, ratio=cfg.select_ratio))


def test_speculation_waits_while_pushes_fill_the_room_and_takes_turns():
    gate = PushGate(ahead_s=0.02)
    rate = 1000.0  # room: 20 bytes
    assert gate.room(rate) == pytest.approx(20) and gate.room(0) == float("inf")
    assert gate.try_speculate("link", "a", rate)
    gate.posted("link", 30)  # a's slice fills the room
    assert not gate.try_speculate("link", "b", rate) and not gate.try_speculate("link", "c", rate)
    assert not gate.try_speculate("link", "b", rate), "asking again keeps one place"
    assert gate.waiting("link") == ["b", "c"]
    assert gate.try_speculate("other", "d", rate), "each link has its own room"
    assert gate.landed("link", 30, rate) == "b", "a landing hands the room to the first waiting"
    assert not gate.try_speculate("link", "c", rate), "c waits for its turn behind b"
    assert gate.try_speculate("link", "b", rate) and gate.waiting("link") == ["c"]
    gate.posted("link", 5)
    assert gate.next_waiting("link", rate) == "c", "room left: the next may go"
    gate.posted("link", 100)  # a proactive set, never held back
    assert gate.next_waiting("link", rate) is None and gate.in_flight("link") == 105
    gate.drop("link", "c")
    assert gate.landed("link", 105, rate) is None and gate.in_flight("link") == 0
    gate.forget("link")
    assert gate.waiting("link") == [] and gate.in_flight("link") == 0
    with pytest.raises(ValueError):
        PushGate(ahead_s=0)


class _Held:
    """Holds back every write batch a lane is asked to post until `release`: the engine sees it posted (and counts
    it in flight), the peer does not have it yet."""

    def __init__(self, lane):
        self.batches = []  # (request id, tag, ops) in posting order
        self._held = []
        self._lock = threading.Lock()
        self._real = lane.post_writes
        lane.post_writes = self._post

    def _post(self, request_id, sources, ops, *, tag):
        mine = Completion()
        with self._lock:
            self.batches.append((request_id, tag, list(ops)))
            self._held.append((request_id, sources, list(ops), tag, mine))
        return mine

    def release(self, request_id=None) -> None:
        with self._lock:
            go = [h for h in self._held if request_id is None or h[0] == request_id]
            self._held = [h for h in self._held if not (request_id is None or h[0] == request_id)]
        for rid, sources, ops, tag, mine in go:
            real = self._real(rid, sources, ops, tag=tag)
            assert real.wait(5)
            mine.set(real.applied)

    def speculative(self, request_id):
        return [ops for rid, tag, ops in self.batches if rid == request_id and tag == "speculative"]


@contextmanager
def _held_engines(monkeypatch, importance):
    """Engines on a slow link's plan (layers 0-1 proactive, the rest speculative), no bridging (slices are whole
    blocks), and the prefill side's push lane held (`_Held`); everything held lands and both close at the end."""
    monkeypatch.setattr("smartgen.engine.prefill.decide.RUN_COST_S", 0.0)
    planner = Planner(LAYOUT.num_layers, LAYOUT.num_blocks, importance, 1e-4, 1e-3)
    prefill, decode, prefill_end = _engines(planner)
    held = _Held(prefill_end.push)
    try:
        yield prefill, decode, prefill_end, held
    finally:
        held.release()
        decode.close()
        prefill.close()


def _tokens_of(ops, decode, request, layer):
    """Tokens of `layer` whose K a batch writes."""
    geometry = decode.pool.geometry
    per_layer = geometry.num_slots * geometry.max_tokens * LAYOUT.token_bytes
    tokens = set()
    for op in ops:
        if op.dst != "k" or op.dst_offset // per_layer != layer:
            continue
        start = (op.dst_offset % per_layer - geometry.kv_offset(0, request.slot, 0)) // LAYOUT.token_bytes
        tokens.update(range(start, start + op.length // LAYOUT.token_bytes))
    return tokens


def _block_tokens(request, flat_block):
    layer, block = divmod(int(flat_block), request.plan.num_blocks)
    bounds = block_bounds(request.length, LAYOUT.num_blocks)
    return layer, torch.arange(int(bounds[block]), int(bounds[block + 1]))


def _fetch(decode, rid, layer, tokens):
    """A decode step's selection of `tokens` (every KV head) in `layer`: what is remote is fetched."""
    index = tokens.expand(LAYOUT.num_kv_heads, tokens.numel()).contiguous()
    decode.assemble(layer, [rid], index)


def test_a_proactive_set_goes_before_speculation_and_a_fetch_trims_what_waits(importance, monkeypatch):
    """Request A speculates while request B prefills on the same link: B's proactive pushes fill the link's room,
    so A's next slice waits until they land, and is planned then, without the entries A's step fetched meanwhile.
    Entries a fetch sends while a push of them is still on the link are counted as crossing twice."""
    with _held_engines(monkeypatch, importance) as (prefill, decode, prefill_end, held):
        policy = get_policy("smartgen")
        rid_a, request_a = _prefilled(prefill, decode, policy)
        held.release()  # A's proactive set lands
        prefill_end.push.flush(5)
        block_bytes = 2 * LAYOUT.token_bytes * 13  # K and V of the largest block (200 tokens in 16)
        request_a.link_rate = 1.25 * block_bytes / prefill_module.CHAIN_WINDOW_S  # one block a slice, room for 2.5
        decode.end_step([rid_a])
        decode.begin_layer(2, [rid_a])  # A's first notice: a one-block slice, held on the link
        _wait(lambda: len(held.speculative(rid_a)) == 1)
        order = request_a.speculative_order()
        first_layer, first_tokens = _block_tokens(request_a, order[0])
        assert _tokens_of(held.speculative(rid_a)[0], decode, request_a, first_layer) == set(first_tokens.tolist())

        _fetch(decode, rid_a, first_layer, first_tokens)  # the slice is still on the link: these cross twice
        entry_bytes = 2 * LAYOUT.token_bytes // LAYOUT.num_kv_heads
        twice = prefill.crossed_twice.snapshot()["bytes"]["on_demand"]
        assert twice == first_tokens.numel() * LAYOUT.num_kv_heads * entry_bytes

        rid_b = decode.open(200, policy)
        request_b = prefill.next_request(timeout=5)
        request_b.link_rate = request_a.link_rate
        k, v = synthetic_kv(LAYOUT, 200, seed=2)
        for layer in range(LAYOUT.num_layers):
            prefill.prefill_layer(rid_b, layer, k[layer], v[layer])  # B's proactive set: posted, held
        key = id(request_a.link)
        assert prefill.gate.in_flight(key) > prefill.gate.room(request_a.link_rate)

        held.release(rid_a)  # A's slice lands: its chain asks for the next, but B's proactive set fills the room
        _wait(lambda: prefill.gate.waiting(key) == [rid_a])
        time.sleep(0.2)
        assert len(held.speculative(rid_a)) == 1, "speculation waits behind a proactive set"

        next_layer, next_tokens = _block_tokens(request_a, order[1])
        _fetch(decode, rid_a, next_layer, next_tokens)  # fetched while A's slice waits: nothing crosses twice
        assert prefill.crossed_twice.snapshot()["bytes"]["on_demand"] == twice

        held.release(rid_b)  # B's proactive set lands: the room goes to A, whose slice is planned now
        _wait(lambda: len(held.speculative(rid_a)) == 2)
        second = held.speculative(rid_a)[1]
        assert not _tokens_of(second, decode, request_a, next_layer) & set(next_tokens.tolist()), "trimmed"
        after_layer, after_tokens = _block_tokens(request_a, order[2])
        assert _tokens_of(second, decode, request_a, after_layer) >= set(after_tokens.tolist())
        assert not prefill.gate.waiting(key)


def _two_speculating(prefill, decode, prefill_end, held) -> list:
    """Two `smartgen` requests prefilled on one link, their proactive sets landed, each speculative slice a block:
    [(id, request)] x 2."""
    pair = [_prefilled(prefill, decode, get_policy("smartgen")) for _ in range(2)]
    held.release()
    prefill_end.push.flush(5)
    for _, request in pair:
        request.link_rate = 1.25 * 2 * LAYOUT.token_bytes * 13 / prefill_module.CHAIN_WINDOW_S
    return pair


def test_a_released_request_leaves_the_queue_and_hands_on(importance, monkeypatch):
    """A request waiting for room that is released (or has nothing left) never blocks the requests behind it."""
    with _held_engines(monkeypatch, importance) as (prefill, decode, prefill_end, held):
        (rid_a, request_a), (rid_b, request_b) = _two_speculating(prefill, decode, prefill_end, held)
        block_bytes = 2 * LAYOUT.token_bytes * 13
        key = id(request_a.link)
        prefill.gate.posted(key, 10 * block_bytes)  # the room is full
        decode.end_step([rid_a, rid_b])
        decode.begin_layer(2, [rid_a, rid_b])
        _wait(lambda: prefill.gate.waiting(key) == [rid_a, rid_b])
        prefill.release(rid_a)
        assert prefill.gate.waiting(key) == [rid_b]
        turn = prefill.gate.landed(key, 10 * block_bytes, request_b.link_rate)
        assert turn == rid_b
        prefill._submit_speculation(lambda _: prefill._hand_on(request_b.link), request_b)
        _wait(lambda: len(held.speculative(rid_b)) == 1)
        assert not held.speculative(rid_a)


def test_the_unscheduled_ablation_speculates_whatever_is_in_flight(importance, monkeypatch):
    """`smartgen-unscheduled` posts its slices as they come, room or not (the gate still counts its pushes)."""
    with _held_engines(monkeypatch, importance) as (prefill, decode, prefill_end, held):
        rid, request = _prefilled(prefill, decode, get_policy("smartgen-unscheduled"))
        held.release()
        prefill_end.push.flush(5)
        request.link_rate = 1.25 * 2 * LAYOUT.token_bytes * 13 / prefill_module.CHAIN_WINDOW_S
        key = id(request.link)
        prefill.gate.posted(key, 1 << 20)  # the room is full
        decode.end_step([rid])
        decode.begin_layer(2, [rid])
        _wait(lambda: len(held.speculative(rid)) == 1)
        assert prefill.gate.waiting(key) == [] and prefill.gate.in_flight(key) > 1 << 20


def test_a_proactive_set_counts_only_the_window_earlier_pushes_leave(importance):
    """Under the link's schedule, a request's K_r is planned again as its prefill starts, less the link time the
    pushes still in flight on its link take (they go first); without the schedule the plan made at OPEN stands."""
    with _first_of_two(importance) as (planner, prefill, decode, _, held, first, opened):
        length = opened.length
        prefill.begin_prefill(opened, length)  # nothing in flight yet: the plan from OPEN stands
        alone = opened.plan.num_proactive
        assert alone == planner.plan(length, "budget", "profile").num_proactive
        assert alone > 2 * opened.plan.num_blocks, "the window holds more than layers 0-1"
        k, v = synthetic_kv(LAYOUT, length, seed=1)
        for layer in range(LAYOUT.num_layers):
            prefill.prefill_layer(first, layer, k[layer], v[layer])  # its pushes are posted, held on the link
        in_flight = prefill.gate.in_flight(id(opened.link))
        assert in_flight > 0
        results = {}
        for scheme in ("smartgen", "smartgen-unscheduled"):
            rid = decode.open(length, get_policy(scheme))
            behind = prefill.next_request(timeout=5)
            prefill.begin_prefill(behind, length)
            results[scheme] = behind.plan.num_proactive
            decode.abort(rid, "planned")  # the pool has two slots
        backlog = in_flight / LAYOUT.kv_bytes(1)
        assert results["smartgen"] == planner.plan(length, "budget", "profile", backlog=backlog).num_proactive
        assert 2 * opened.plan.num_blocks <= results["smartgen"] < alone
        assert results["smartgen-unscheduled"] == alone


@contextmanager
def _first_of_two(importance):
    """Engines whose planner's K_r nears every block, and a first request of 200 tokens opened on them (the pool
    has two slots); yields (planner, prefill, decode, the prefill end of their link, held pushes, its id, its
    OpenedRequest)."""
    planner = Planner(LAYOUT.num_layers, LAYOUT.num_blocks, importance, 1e-3, 1e-3)
    prefill, decode, prefill_end = _engines(planner)
    held = _Held(prefill_end.push)
    try:
        first = decode.open(200, get_policy("smartgen"))
        yield planner, prefill, decode, prefill_end, held, first, prefill.next_request(timeout=5)
    finally:
        held.release()
        decode.close()
        prefill.close()


def test_the_link_s_backlog_shortens_the_proactive_window():
    planner = Planner(LAYOUT.num_layers, LAYOUT.num_blocks, None, 1e-3, 1e-3)
    full_window = planner.budget(200, "budget")
    assert planner.budget(200, "budget", backlog=0.0) == full_window
    assert planner.budget(200, "budget", backlog=50) < full_window
    assert planner.budget(200, "budget", backlog=10_000) == planner.budget(200, "floor")  # the clip's floor
    assert planner.budget(200, "floor", backlog=10_000) == planner.budget(200, "floor")


def test_a_head_started_request_speculates_behind_one_decoding_on_its_decode_node(importance, monkeypatch):
    """While this prefill node decodes B itself (a head start: its tokens wait for no link), B's speculation goes
    behind A's, whose decode node is decoding and waits for the link; B's resumes once A has nothing left to push,
    and B is no longer behind anyone once its head start ends (step-2 FORECAST)."""
    with _held_engines(monkeypatch, importance) as (prefill, decode, prefill_end, held):
        (rid_a, request_a), (rid_b, request_b) = _two_speculating(prefill, decode, prefill_end, held)

        def head_step() -> None:  # the prefill worker's call before each head-start step of B's
            request_b.last_idle = time.monotonic() - 0.05  # a step ago: a slice's worth of link since
            prefill.note_head_step(rid_b)

        def pushed_everything(request) -> None:  # its next chained slice finds nothing left
            request.spec_cursor = request.speculative_order().numel()

        head_step()  # no request decodes on its decode node yet: B's KV crosses
        _wait(lambda: len(held.speculative(rid_b)) == 1)
        assert request_b.heading
        pushed_everything(request_b)
        held.release(rid_b)
        time.sleep(0.1)
        request_b.spec_cursor = 1  # the rest of B's order is left to push
        sent_b = len(held.speculative(rid_b))

        decode.end_step([rid_a])
        decode.begin_layer(2, [rid_a])  # A decodes on its decode node: its notice's slice goes
        _wait(lambda: len(held.speculative(rid_a)) == 1)
        head_step()
        time.sleep(0.2)
        assert len(held.speculative(rid_b)) == sent_b, "a head-started request's speculation waits behind A's"

        pushed_everything(request_a)
        held.release(rid_a)
        head_step()  # A has nothing left to push: B's turn
        _wait(lambda: len(held.speculative(rid_b)) == sent_b + 1)

        request_a.spec_cursor = 0  # A has KV left again, but B's head start ends: its chain goes on regardless
        prefill.send_forecast(rid_b, {}, step=2)
        assert not request_b.heading
        held.release(rid_b)
        _wait(lambda: len(held.speculative(rid_b)) == sent_b + 2)


def test_a_request_decoded_here_leaves_its_proactive_window_to_requests_handed_on(importance):
    """A request its prefill node expects to decode itself (a head start) pushes only layers 0-1 while a request
    handed on earlier still has KV to push on the same link; its K_r leads its speculative order instead. Alone on
    the link, or under `smartgen-eager-proactive`, its plan is the one made at OPEN."""
    with _first_of_two(importance) as (_, prefill, decode, prefill_end, held, first, opened):
        length = opened.length
        budget = opened.plan
        prefill.begin_prefill(opened, length, head_start=True)  # no request handed on before it: the plan stands
        assert torch.equal(opened.plan.proactive, budget.proactive)
        k, v = synthetic_kv(LAYOUT, length, seed=1)
        for layer in range(LAYOUT.num_layers):
            prefill.prefill_layer(first, layer, k[layer], v[layer])  # prefilled, handed on, its speculation to come
        held.release()
        prefill_end.push.flush(5)
        plans = {}
        for scheme, head_start in (("smartgen", True), ("smartgen", False), ("smartgen-eager-proactive", True)):
            rid = decode.open(length, get_policy(scheme))
            behind = prefill.next_request(timeout=5)
            at_open = behind.plan
            prefill.begin_prefill(behind, length, head_start=head_start)
            plans[scheme, head_start] = (at_open, behind.plan)
            decode.abort(rid, "planned")  # the pool has two slots
        at_open, deferred = plans["smartgen", True]
        blocks = deferred.num_blocks
        assert deferred.proactive[:2].all() and not deferred.proactive[2:].any()
        moved = (at_open.proactive & ~deferred.proactive).flatten().nonzero().flatten()
        assert moved.numel() > 0, "K_r held more than layers 0-1"
        assert torch.equal(deferred.speculative_order[: moved.numel()], moved)
        assert torch.equal(deferred.speculative_order[moved.numel() :], at_open.speculative_order)
        assert deferred.num_layers * blocks == deferred.num_proactive + deferred.speculative_order.numel()
        for key in (("smartgen", False), ("smartgen-eager-proactive", True)):
            before, after = plans[key]
            assert torch.equal(after.proactive, before.proactive), key


def test_deferring_a_plan_keeps_a_held_prefix_proactive():
    planner = Planner(LAYOUT.num_layers, LAYOUT.num_blocks, None, 1e-3, 1e-3)
    plan = planner.plan(200, "budget", "sequential")
    deferred = defer_proactive(plan, keep_blocks=3)
    assert deferred.proactive[:2].all() and deferred.proactive[2:, :3].equal(plan.proactive[2:, :3])
    assert not deferred.proactive[2:, 3:].any()
    assert sorted(deferred.speculative_order.tolist()) == sorted(
        (~deferred.proactive).flatten().nonzero().flatten().tolist()
    )


def test_a_prompt_arriving_mid_prefill_restores_the_deferred_proactive_set(importance, monkeypatch):
    """No head start follows a prefill that a prompt arrived during: from the next layer on, the request's plan from
    before the deferral stands, and its K_r blocks of the layers prefilled already go at once, proactively."""
    with _first_of_two(importance) as (_, prefill, decode, prefill_end, held, first, opened):
        length = opened.length
        k, v = synthetic_kv(LAYOUT, length, seed=1)
        for layer in range(LAYOUT.num_layers):
            prefill.prefill_layer(first, layer, k[layer], v[layer])
        held.release()
        prefill_end.push.flush(5)
        second = decode.open(length, get_policy("smartgen"))
        behind = prefill.next_request(timeout=5)
        at_open = behind.plan
        prefill.begin_prefill(behind, length, head_start=True)
        assert behind.deferred_plan is at_open and not behind.plan.proactive[2:].any()
        arrived_at = 3
        for layer in range(LAYOUT.num_layers):
            if layer == arrived_at:
                monkeypatch.setattr(prefill, "_prompt_waiting", lambda: True)
                before = prefill.counters.snapshot()["bytes"]["proactive"]
            prefill.prefill_layer(second, layer, k[layer], v[layer])
            if layer == arrived_at:
                posted = prefill.counters.snapshot()["bytes"]["proactive"] - before
                # the K_r blocks of layers 2 .. arrived_at - 1, deferred, and of layer arrived_at, at once
                sizes = block_bounds(length, at_open.num_blocks).diff()
                tokens = int((at_open.proactive[2 : arrived_at + 1].long() * sizes).sum())
                assert posted == tokens * LAYOUT.kv_bytes(1, num_layers=1)
        assert behind.deferred_plan is None and behind.plan is at_open
        assert torch.equal(behind.sent, at_open.proactive)


def test_a_deferred_plan_keeps_the_window_earlier_pushes_leave(importance):
    """What a prompt arriving mid-prefill restores is the plan made as the prefill started, K_r less the link time
    of the pushes still in flight ahead of it, not the plan made at OPEN."""
    with _first_of_two(importance) as (planner, prefill, decode, _, held, first, opened):
        length = opened.length
        k, v = synthetic_kv(LAYOUT, length, seed=1)
        for layer in range(LAYOUT.num_layers):
            prefill.prefill_layer(first, layer, k[layer], v[layer])  # posted, held on the link: a backlog
        in_flight = prefill.gate.in_flight(id(opened.link))
        assert in_flight > 0
        decode.open(length, get_policy("smartgen"))
        behind = prefill.next_request(timeout=5)
        prefill.begin_prefill(behind, length, head_start=True)
        window = planner.plan(length, "budget", "profile", backlog=in_flight / LAYOUT.kv_bytes(1))
        assert behind.deferred_plan is not None
        assert torch.equal(behind.deferred_plan.proactive, window.proactive)
        assert behind.plan.proactive[:2].all() and not behind.plan.proactive[2:].any()
