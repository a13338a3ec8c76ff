"""The first-token bound judges progress, not patience: a request whose KV keeps arriving, however slowly, or that
waits on its link behind requests whose KV keeps arriving, is never failed for taking long; one for which nothing
arrived for the bound is, and its reason says how much had arrived and since when nothing came."""

import time
import types

import torch
from inproc_nodes import decode_node, prefill_node, tiny_parts

from smartgen.engine import messages as msg
from smartgen.engine.decode import DecodeEngine, Stall
from smartgen.engine.decode.progress import Arrival, landed_entries
from smartgen.engine.layout import KVLayout
from smartgen.engine.mask import LOCAL
from smartgen.engine.metrics import RequestMetrics
from smartgen.engine.policy import POLICIES, get_policy
from smartgen.lanes.link import inproc_link
from smartgen.roles.limits import DecodeLimits
from smartgen.roles.service import FinishEvent, GenerationParams
from smartgen.runtime.driver import DecodeDriver, DriverRequest, Finished

BOUND = 10.0  # seconds of the fake clock
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, num_blocks=16)


class _Engine:
    """What collect_first_tokens asks of a DecodeEngine, for one request of 8 KV entries: `landed` of them are in at
    the fake clock's `now`, and `stall` judges it with the engine's own record of progress (progress.Arrival)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.landed = 0
        self.first_token = False
        self.arrival = Arrival(8, 0, dispatched_at=0.0)
        self._metrics = RequestMetrics("r", 4)

    def first_token_ready(self, request_id: str) -> bool:
        return self.first_token

    def token_arrives(self) -> None:
        self.first_token = True
        self.arrival.note(self.now)  # a message for it: progress

    def wait_first_token(self, request_id: str, timeout: float | None = None) -> int:
        self._metrics.record_token(self.now)
        return 7

    def metrics(self, request_id: str) -> RequestMetrics:
        return self._metrics

    def is_all_local(self, request_id: str) -> bool:
        return self.landed == self.arrival.num_entries

    def dense_layers_local(self, request_id: str) -> bool:
        return True

    def head_pending(self, request_id: str) -> bool:  # full transfer: no head start
        return False

    def request_metadata(self, request_id: str) -> list:
        return []

    def has_request(self, request_id: str) -> bool:
        return True

    def abort(self, request_id: str, reason: str) -> None:
        pass

    def stall(self, request_id: str, bound: float) -> Stall | None:
        arrival = self.arrival
        arrival.count(self.landed, self.now, since=arrival.dispatched_at)
        idle = self.now - arrival.last_at
        if idle <= bound:
            return None
        last = arrival.last_at - arrival.dispatched_at if arrival.last_at > arrival.dispatched_at else None
        return Stall(idle, arrival.num_landed, arrival.num_entries, last, num_ahead=0, behind=False)


def _full_transfer(engine: _Engine) -> DecodeDriver:
    driver = DecodeDriver(types.SimpleNamespace(engine=engine), prefill_timeout=BOUND)  # type: ignore[arg-type]
    driver.prefilling = [DriverRequest("r", torch.arange(4), get_policy("full"), max_tokens=8)]
    return driver


def _run_until_finished(driver: DecodeDriver, engine: _Engine, seconds: range) -> tuple[float, Finished] | None:
    for second in seconds:
        engine.now = float(second)
        for event in driver.collect_first_tokens():
            if isinstance(event, Finished):
                return engine.now, event
    return None


def test_kv_that_keeps_arriving_slowly_is_not_failed_however_long_it_takes():
    engine = _Engine()
    driver = _full_transfer(engine)
    engine.token_arrives()
    for second in range(1, 8 * 9 + 1):  # one entry every 9 s: the transfer takes 72 s, over 7 bounds
        engine.now = float(second)
        if second % 9 == 0:
            engine.landed += 1
        events = driver.collect_first_tokens()
        assert not [e for e in events if isinstance(e, Finished)], (second, events)
    assert [r.request_id for r in driver.running] == ["r"] and not driver.prefilling  # all in: it decodes


def test_kv_that_stops_arriving_fails_at_the_bound_saying_how_much_came_and_when():
    engine = _Engine()
    driver = _full_transfer(engine)
    engine.token_arrives()
    for second in (1, 2, 3):
        engine.now = float(second)
        engine.landed += 1
        driver.collect_first_tokens()
    ended = _run_until_finished(driver, engine, range(4, 60))
    assert ended is not None
    at, finished = ended
    assert at == 14.0 and finished.reason == "timeout"  # 10 s after the last entry, not after dispatch
    assert finished.error == (
        "its KV stalled: nothing arrived for it for 11.0 s (bound 10 s); 3 of its 8 KV entries had arrived (38%); "
        "the last arrival was 3.0 s after its dispatch"
    )


def test_no_first_token_and_nothing_arriving_fails_at_the_bound():
    engine = _Engine()
    driver = _full_transfer(engine)
    ended = _run_until_finished(driver, engine, range(1, 60))
    assert ended is not None
    at, finished = ended
    assert at == 11.0 and finished.reason == "timeout"
    assert finished.error == (
        "no first token: nothing arrived for it for 11.0 s (bound 10 s); 0 of its 8 KV entries had arrived (0%); "
        "nothing had come since its dispatch"
    )


# -- the engine's own signal: its masks, its messages, the requests ahead on its link ------------------------------
def _engine_with_link() -> DecodeEngine:
    engine = DecodeEngine(LAYOUT, num_slots=3, max_tokens=32)
    engine._links.append(inproc_link()[1])  # open() needs a prefill node to address; nothing listens here
    return engine


def test_the_engine_counts_kv_landing_in_the_pool_as_progress():
    engine = _engine_with_link()
    rid = engine.open(10, POLICIES["full"])
    start, slot = time.monotonic(), engine.slot_of(rid)
    for layer in range(LAYOUT.num_layers):  # a layer every 0.9 s: 3.6 s in all, bound 1 s
        now = start + 0.9 * (layer + 1)
        engine.pool.masks.set_local(layer, slot, 0, 10)
        assert engine.stall(rid, 1.0, now) is None, layer
    stalled = engine.stall(rid, 1.0, now + 1.1)
    assert stalled is not None and stalled.num_landed == stalled.num_entries == 4 * 10 * 2
    assert stalled.num_ahead == 0 and stalled.last_s is not None and stalled.last_s >= 3.6


def test_a_request_queued_behind_another_on_its_link_waits_while_that_ones_kv_lands():
    engine = _engine_with_link()
    ahead, behind = engine.open(10, POLICIES["full"]), engine.open(10, POLICIES["full"])
    engine._links.append(inproc_link()[1])
    elsewhere = engine.open(10, POLICIES["full"])  # the least loaded link: the new one
    start, slot = time.monotonic(), engine.slot_of(ahead)
    assert engine.stall(behind, 1.0, start + 0.1) is None  # its first look, right after its dispatch
    assert engine.stall(elsewhere, 1.0, start + 0.1) is None
    for layer in range(LAYOUT.num_layers):  # the request ahead lands a layer every 0.8 s; nothing lands for `behind`
        now = start + 0.8 * (layer + 1)
        engine.pool.masks.set_local(layer, slot, 0, 10)
        assert engine.stall(behind, 1.0, now) is None, layer
    alone = engine.stall(elsewhere, 1.0, now)  # on another link: the first request's progress is not its own
    assert alone is not None and alone.num_ahead == 0
    stalled = engine.stall(behind, 1.0, now + 1.1)  # the request ahead is all in, and nothing comes any more
    assert stalled is not None and stalled.num_ahead == 1 and stalled.num_landed == 0 and stalled.last_s is None
    assert stalled.describe(1.0) == (
        "nothing arrived for it nor for the requests queued ahead of it on its link for 1.1 s (bound 1 s); "
        "0 of its 80 KV entries had arrived (0%); nothing had come since its dispatch"
    )


def test_the_last_arrival_of_a_request_that_left_still_counts_for_the_one_behind_it():
    """The request ahead finishes (its KV all in, its tokens out) before the link's first push for the next one
    lands: that gap is the link turning to the next transfer, not a stall; and what landed for it since the last
    look counts as it leaves."""
    engine = _engine_with_link()
    ahead, behind = engine.open(10, POLICIES["full"]), engine.open(10, POLICIES["full"])
    time.sleep(0.1)  # past one scan interval: its first look
    assert engine.stall(behind, 1.0) is None
    engine.pool.masks.values[:, engine.slot_of(ahead), :10] = LOCAL  # all of it, and no look before it leaves
    engine.finish(ahead)
    left = time.monotonic()
    assert engine.stall(behind, 1.0, left + 0.9) is None  # gone, but it was still arriving as it left
    stalled = engine.stall(behind, 1.0, left + 1.2)
    assert stalled is not None and stalled.num_ahead == 0 and stalled.behind


def test_kv_that_landed_before_a_request_was_dispatched_is_not_its_progress():
    engine = _engine_with_link()
    ahead = engine.open(10, POLICIES["full"])
    engine.pool.masks.set_local(0, engine.slot_of(ahead), 0, 10)  # before `behind` exists; nobody looked
    behind = engine.open(10, POLICIES["full"])
    start = time.monotonic()
    assert engine.stall(behind, 1.0, start + 0.5) is None
    stalled = engine.stall(behind, 1.0, start + 1.2)
    assert stalled is not None and stalled.num_ahead == 1


def test_a_message_for_the_request_is_progress():
    engine = _engine_with_link()
    rid = engine.open(10, POLICIES["smartgen"])
    time.sleep(0.3)
    now = time.monotonic()
    engine._handle(msg.Metadata(rid, 0, {}))
    assert engine.stall(rid, 0.25, now) is None  # 0.3 s after its dispatch, but its metadata just came
    stalled = engine.stall(rid, 0.25, now + 0.3)
    assert stalled is not None and stalled.last_s is not None and stalled.last_s >= 0.3


def test_a_quantized_layer_counts_once_its_packed_bytes_are_in():
    engine = DecodeEngine(LAYOUT, num_slots=1, max_tokens=32)
    slot = engine.pool.allocate(10)
    assert landed_entries(engine.pool, slot, 10, quantized=True) == 0
    engine.pool.quant_ready[2, slot] = 1  # the flag a lane writes after a packed layer
    engine.pool.masks.set_local(0, slot, 0, 4)
    assert landed_entries(engine.pool, slot, 10, quantized=True) == 10 * 2 + 4 * 2


# -- real nodes --------------------------------------------------------------------------------------------------
def test_full_transfers_slower_than_the_bound_succeed_while_their_kv_arrives():
    """Two full transfers on one slow link (0.4 Mbit/s: a layer of a 100-token prompt every ~0.5 s, a request's KV in
    ~2 s) with a first-token bound of 1.5 s: the second request's KV starts only once the first's is in, so it goes
    longer than the bound with nothing of its own arriving, and both take longer than the bound in all. Neither
    fails: each was making progress, or waiting behind progress (with the bound counted from dispatch, both failed
    with "its KV did not arrive within 1.5 s")."""
    parts = tiny_parts()
    bound = 1.5
    prefill = prefill_node(parts, link_gbps=0.0004)
    decode = decode_node(parts, [prefill], scheme="full", limits=DecodeLimits(first_token_timeout_s=bound))
    try:
        params = GenerationParams(max_tokens=4, scheme="full", ignore_eos=True)
        prompts = [torch.randint(3, 90, (100,), generator=torch.Generator().manual_seed(s)).tolist() for s in (1, 2)]
        handles = [decode.scheduler.submit(prompt, params) for prompt in prompts]
        finishes = [list(handle.events(timeout=120))[-1] for handle in handles]
        assert all(isinstance(f, FinishEvent) and f.reason == "length" for f in finishes), finishes
        first, second = (f.usage["ttst"] for f in finishes)  # the second token waits for the whole KV
        assert first > bound and second > 2 * bound, (first, second)
    finally:
        decode.stop()
        prefill.stop()
