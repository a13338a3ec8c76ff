"""The three paths and the baselines end to end on a synthetic cache and trace, over the in-process lane; every
policy's bit-exact run also over every lane this machine has."""

import time

import pytest
import torch
from conftest import LANE_KINDS, SOFT_RDMA, lane_available, lane_params, make_link

import smartgen.apps.simulate as simulate_module
import smartgen.engine.decode as decode_module
import smartgen.engine.decode.decide as decode_decide
import smartgen.engine.prefill as prefill_module
from smartgen.apps.simulate import SimulationConfig, calibrate, simulate
from smartgen.apps.synthetic import SyntheticTrace, synthetic_kv
from smartgen.engine.decode import DecodeEngine, RequestFailed
from smartgen.engine.layout import KVLayout
from smartgen.engine.mask import LOCAL, REMOTE
from smartgen.engine.messages import Idle, Release
from smartgen.engine.planning import Planner, speculative_slice_size
from smartgen.engine.policy import POLICIES, get_policy
from smartgen.engine.pool import DecodePool
from smartgen.engine.prefill import PrefillEngine
from smartgen.lanes.link import inproc_link

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, num_blocks=16)


def config(**overrides) -> SimulationConfig:
    base = dict(layout=LAYOUT, lengths=(100, 37), steps=5, select_ratio=0.2, gbps=0.2, prefill_seconds_per_token=2e-5)
    base.update(overrides)
    return SimulationConfig(**base)


@pytest.fixture(scope="module")
def importance():
    cfg = config()
    return calibrate(cfg, SyntheticTrace(LAYOUT.num_layers, LAYOUT.num_kv_heads, ratio=cfg.select_ratio))


@pytest.mark.parametrize("lane", lane_params(*LANE_KINDS))
@pytest.mark.parametrize("name", [n for n, p in POLICIES.items() if not p.quantize_bits])  # lossy: test_quant_transfer
def test_every_policy_assembles_the_true_kv(name, lane, importance, remote_read_guard):
    policy = POLICIES[name]
    result = simulate(config(transport=lane_available(lane)), policy, importance)
    assert result.mismatches == 0, "assembled KV must equal the selected ground truth bit for bit"
    assert remote_read_guard == [], "an entry was read from the pool while its mask said remote"
    assert result.max_fetch_count <= 1, "an entry was fetched twice"
    assert result.prefill_requests_left == 0
    assert all(r["error"] is None for r in result.requests)
    if policy.speculative or policy.wait_for_all:
        assert result.all_local and result.pool_equals_prefill


@pytest.mark.parametrize("staged", [False, True], ids=["pool", "staged"])
@pytest.mark.parametrize("name", ["partial", "partial+profile+parallel", "smartgen"])
def test_fetch_replies_land_in_place_over_the_rdma_lane_bit_for_bit(
    name, staged, importance, remote_read_guard, monkeypatch
):
    """The RDMA lane (over software verbs endpoints) puts each fetch reply straight into the pool rows the FETCH
    named (staged: into the host copies, moved into K and V when they become local); the assembled KV must still
    equal the ground truth, and no reply may have been copied in instead."""
    landed, copied = [], []
    real_landed, real_write = DecodePool.entries_landed, DecodePool.write_entries
    monkeypatch.setattr(simulate_module, "loopback_link", make_link)
    monkeypatch.setattr(DecodePool, "entries_landed", lambda self, *a: landed.append(1) or real_landed(self, *a))
    monkeypatch.setattr(DecodePool, "write_entries", lambda self, *a: copied.append(1) or real_write(self, *a))
    result = simulate(config(transport=SOFT_RDMA, staged=staged), POLICIES[name], importance)
    assert result.mismatches == 0 and result.max_fetch_count <= 1
    assert remote_read_guard == []
    assert all(r["error"] is None for r in result.requests)
    assert landed and not copied


@pytest.mark.parametrize("strategy", ["random", "sequential", "streaming", "optimal"])
def test_smartgen_with_every_proactive_strategy(strategy, importance):
    result = simulate(config(gbps=None), get_policy("smartgen", strategy=strategy), importance)
    assert result.mismatches == 0 and result.max_fetch_count <= 1
    assert result.all_local and result.pool_equals_prefill and result.prefill_requests_left == 0


def test_bfloat16_cache_is_moved_bit_for_bit(importance):
    layout = KVLayout(4, 2, 8, dtype=torch.bfloat16, num_blocks=16)
    result = simulate(config(layout=layout, lengths=(50,)), POLICIES["smartgen"], importance)
    assert result.mismatches == 0 and result.pool_equals_prefill


def test_full_transfer_sends_all_kv_once(importance):
    cfg = config()
    result = simulate(cfg, POLICIES["full"], importance)
    assert result.path_bytes == {
        "proactive": sum(LAYOUT.kv_bytes(n) for n in cfg.lengths),
        "speculative": 0,
        "on_demand": 0,
    }


def _expected_proactive_bytes(planner: Planner, policy, length: int) -> int:
    plan = planner.plan(length, policy.proactive, policy.strategy)
    from smartgen.engine.layout import block_bounds

    sizes = block_bounds(length, LAYOUT.num_blocks)[1:] - block_bounds(length, LAYOUT.num_blocks)[:-1]
    tokens = int((plan.proactive.long() * sizes).sum())
    return tokens * 2 * LAYOUT.token_bytes


def test_smartgen_bytes_match_the_plan(importance):
    # A link slow enough that K_r sits between the clip's bounds.
    cfg = config(lengths=(160,), gbps=0.05, prefill_seconds_per_token=1e-4)
    policy = POLICIES["smartgen"]
    planner = Planner(LAYOUT.num_layers, LAYOUT.num_blocks, importance, 1e-4, LAYOUT.kv_bytes(1) * 8 / 0.05e9)
    budget = planner.budget(160, "budget")
    assert 2 * 16 < budget < 4 * 16
    result = simulate(cfg, policy, importance)
    assert result.path_bytes["proactive"] == _expected_proactive_bytes(planner, policy, 160)
    # proactive + speculative + on demand cover the whole cache, and a push never resends what a fetch brought in
    # every head (speculation starts with the second decode step, so the first step's fetches are not pushed)
    pushed = result.path_bytes["proactive"] + result.path_bytes["speculative"]
    assert pushed <= LAYOUT.kv_bytes(160) <= pushed + result.path_bytes["on_demand"]


def test_partial_pushes_layers_0_and_1_only(importance):
    cfg = config(lengths=(64,), gbps=None)
    result = simulate(cfg, POLICIES["partial"], importance)
    assert result.path_bytes["proactive"] == LAYOUT.kv_bytes(64, num_layers=2)
    assert result.path_bytes["speculative"] == 0
    assert result.on_demand_ratio > 0


class _Spy:
    """Records every write batch a lane posts."""

    def __init__(self, lane):
        self.lane = lane
        self.batches = []
        real = lane.post_writes

        def post(request_id, sources, ops, *, tag):
            self.batches.append((tag, list(ops)))
            return real(request_id, sources, ops, tag=tag)

        lane.post_writes = post


def _engines(policy_planner, gbps=None):
    prefill = PrefillEngine(LAYOUT, policy_planner)
    decode = DecodeEngine(LAYOUT, num_slots=2, max_tokens=256)
    prefill_end, decode_end = inproc_link(gbps)
    prefill.attach(prefill_end, decode.pool.geometry)
    decode.attach(decode_end)
    return prefill, decode, prefill_end


def _prefilled(prefill: PrefillEngine, decode: DecodeEngine, policy, length: int = 200):
    """Opens a request, prefills every layer of a synthetic cache and waits for its first token: (id, request)."""
    rid = decode.open(length, policy)
    request = prefill.next_request(timeout=5)
    k, v = synthetic_kv(LAYOUT, length, seed=1)
    for layer in range(LAYOUT.num_layers):
        prefill.prefill_layer(rid, layer, k[layer], v[layer])
    prefill.finish_prefill(rid, 0)
    decode.wait_first_token(rid, timeout=5)
    return rid, request


def _record_control(request) -> list:
    """Records every message the decode node sends on the request's control lane (still sending each); returns the
    list they go into."""
    sent: list = []
    send = request.link.control.send

    def spy(message, *args, **kwargs):
        sent.append(message)
        return send(message, *args, **kwargs)

    request.link.control.send = spy
    return sent


def _first_step(decode: DecodeEngine, rid: str) -> None:
    """A first decode step whose selection meets remote entries in every sparse layer (tokens 100-103, fetched),
    so the next step prefetches wherever KV is still remote."""
    index = torch.arange(100, 104).expand(LAYOUT.num_kv_heads, 4).contiguous()
    for layer in range(2, LAYOUT.num_layers):
        decode.assemble(layer, [rid], index)
    decode.end_step([rid])


def test_speculation_sends_the_rest_in_importance_order_a_ratio_per_notice(importance, monkeypatch):
    # slow link: K_r hits the clip's floor, so everything past layers 0-1 goes speculatively
    # the in-process link here is unpaced, so its measured rate would make slices resend short gaps of blocks
    # already sent (tests/test_bridging.py); this test is about which blocks each slice chooses
    monkeypatch.setattr("smartgen.engine.prefill.decide.RUN_COST_S", 0.0)
    planner = Planner(LAYOUT.num_layers, LAYOUT.num_blocks, importance, 1e-4, 1e-3)
    prefill, decode, prefill_end = _engines(planner)
    spy = _Spy(prefill_end.push)
    try:
        policy = get_policy("smartgen-paper", speculative_ratio=0.1)  # a slice per notice, none chained
        rid, request = _prefilled(prefill, decode, policy)
        decode.begin_layer(2, [rid])  # in the first decode step: no idle notice, speculation waits
        time.sleep(0.05)
        assert not [tag for tag, _ in spy.batches if tag == "speculative"]
        decode.end_step([rid])  # the first step done: notices flow
        spy.lane.flush(5)  # every proactive push has landed: none measures the link's rate after the next line
        request.link_rate = 1e15  # unpaced: a loaded machine's slow copies must not size the slices
        plan = request.plan
        assert plan.num_proactive == 2 * LAYOUT.num_blocks
        size = speculative_slice_size(plan.num_layers * plan.num_blocks, 0.1)
        pushed = []
        while not request.speculation_done:
            before = len(spy.batches)
            decode.begin_layer(2, [rid])  # idle notice
            deadline = time.monotonic() + 5
            while len(spy.batches) == before and time.monotonic() < deadline:
                time.sleep(0.001)
            tag, ops = spy.batches[-1]
            assert tag == "speculative"
            spy.lane.flush(5)  # let the slice land before the next notice
            pushed.append(ops)
        order = plan.speculative_order.tolist()
        # the first notice has no window behind it: one block, then the ratio's share per notice (unpaced link)
        slices = [order[:1]] + [sorted(order[i : i + size]) for i in range(1, len(order), size)]
        assert len(pushed) == len(slices)
        for ops, expected in zip(pushed, slices):
            assert sorted(_blocks_of(ops, decode, request)) == expected
        assert decode.release_fully_local([rid]) == [rid]
        deadline = time.monotonic() + 5
        while rid in prefill.store and time.monotonic() < deadline:
            time.sleep(0.001)
        assert rid not in prefill.store, "RELEASE frees the prefill store"
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("release_early", [False, True])
def test_chained_speculation_needs_one_notice_and_stops_at_release(importance, monkeypatch, release_early):
    """smartgen chains its slices: after the first idle notice, each landed slice is followed by the next (in the
    plan's order, each what the link moves in CHAIN_WINDOW_S) with no further notice, until everything is
    sent; a RELEASE stops the chain."""
    monkeypatch.setattr("smartgen.engine.prefill.decide.RUN_COST_S", 0.0)
    planner = Planner(LAYOUT.num_layers, LAYOUT.num_blocks, importance, 1e-4, 1e-3)
    prefill, decode, prefill_end = _engines(planner)
    spy = _Spy(prefill_end.push)
    try:
        assert get_policy("smartgen").chain and not get_policy("smartgen-paper").chain
        rid, request = _prefilled(prefill, decode, get_policy("smartgen"))
        decode.end_step([rid])
        spy.lane.flush(5)
        block_bytes = 2 * LAYOUT.token_bytes * 13  # K and V of the largest block (200 tokens in 16)
        request.link_rate = 3.2 * block_bytes / prefill_module.CHAIN_WINDOW_S  # a chained slice: 3 blocks
        decode.begin_layer(2, [rid])  # the only notice: its slice is one block (no window yet), then the chain
        if release_early:
            _wait(lambda: len([t for t, _ in spy.batches if t == "speculative"]) >= 3)
            decode._release(decode._require(rid), Release(rid))
            _wait(lambda: rid not in prefill.store)
            # a chained slice planned before the release may still be posting: let the speculation thread finish it
            prefill._speculation.submit(lambda: None).result(5)
            count = len(spy.batches)
            time.sleep(0.2)
            assert len(spy.batches) == count, "a released request's chain stops"
            assert not request.speculation_done
            return
        _wait(lambda: request.speculation_done)
        prefill._speculation.submit(lambda: None).result(5)  # the chain's last push is posted
        spec = [ops for tag, ops in spy.batches if tag == "speculative"]
        order = request.plan.speculative_order.tolist()
        assert len(spec) > 2, "one notice, then slices chained on their own"
        chained = [b for i in range(1, len(order), 3) for b in sorted(order[i : i + 3])]
        assert [b for ops in spec for b in sorted(_blocks_of(ops, decode, request))] == order[:1] + chained
        prefill_end.push.flush(5)
        assert decode.hint_factor([rid]) > 0 and decode.prefetch_wanted([rid])
        assert decode.release_fully_local([rid]) == [rid]
        # all local: no wider ranking for hints, no speculated selection to prefetch (they cost step time)
        assert decode.hint_factor([rid]) == 0 and not decode.prefetch_wanted([rid])
    finally:
        decode.close()
        prefill.close()


def _wait(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def _blocks_of(ops, decode, request):
    """Flat block ids covered by the K descriptors of a batch."""
    from smartgen.engine.layout import block_bounds

    geometry = decode.pool.geometry
    bounds = block_bounds(request.length, LAYOUT.num_blocks).tolist()
    per_layer = geometry.num_slots * geometry.max_tokens * LAYOUT.token_bytes
    ids = []
    for op in ops:
        if op.dst != "k":
            continue
        layer, rest = divmod(op.dst_offset, per_layer)
        start = (rest - geometry.kv_offset(0, request.slot, 0)) // LAYOUT.token_bytes
        stop = start + op.length // LAYOUT.token_bytes
        ids += [
            layer * request.plan.num_blocks + m
            for m in range(len(bounds) - 1)
            if start <= bounds[m] and bounds[m + 1] <= stop
        ]
    return ids


def test_a_lost_prefill_node_fails_requests_and_frees_everything(importance):
    planner = Planner(LAYOUT.num_layers, LAYOUT.num_blocks, importance)
    prefill, decode, prefill_end = _engines(planner)
    try:
        rid = decode.open(64, POLICIES["smartgen"])
        assert prefill.next_request(timeout=5) is not None
        prefill_end.close()  # the prefill node dies before its first token
        with pytest.raises(RequestFailed, match="connection lost"):
            decode.wait_first_token(rid, timeout=10)
        decode.abort(rid, "prefill node lost")
        assert decode.pool.num_free == 2
        assert int(decode.pool.masks.values.abs().sum()) == 0
    finally:
        decode.close()
        prefill.close()


def test_a_lost_decode_node_frees_the_prefill_store(importance):
    planner = Planner(LAYOUT.num_layers, LAYOUT.num_blocks, importance)
    prefill, decode, _ = _engines(planner)
    try:
        decode.open(64, POLICIES["smartgen"])
        assert prefill.next_request(timeout=5) is not None
        assert prefill.store.num_requests == 1
        decode.close()
        deadline = time.monotonic() + 5
        while prefill.store.num_requests and time.monotonic() < deadline:
            time.sleep(0.001)
        assert prefill.store.num_requests == 0
    finally:
        prefill.close()


def test_prefill_errors_reach_the_decode_node_as_a_reason(importance):
    prefill, decode, _ = _engines(Planner(LAYOUT.num_layers, LAYOUT.num_blocks, None))
    try:
        rid = decode.open(64, POLICIES["smartgen"])  # the prefill node has no profile
        with pytest.raises(RequestFailed, match="no profile"):
            decode.wait_first_token(rid, timeout=10)
    finally:
        decode.close()
        prefill.close()


def test_pool_refuses_what_it_cannot_hold():
    from smartgen.engine.pool import PoolFull

    decode = DecodeEngine(LAYOUT, num_slots=1, max_tokens=32)
    with pytest.raises(PoolFull, match="holds 32"):
        decode.pool.allocate(30, 5)
    decode.pool.allocate(10)
    with pytest.raises(PoolFull, match="in use"):
        decode.pool.allocate(10)


def test_generated_tokens_are_local_at_once():
    decode = DecodeEngine(LAYOUT, num_slots=1, max_tokens=32)
    slot = decode.pool.allocate(10, 4)
    for layer in range(LAYOUT.num_layers):
        assert decode.pool.append(layer, slot, torch.ones(2, 8), torch.ones(2, 8)) == 10
    assert bool((decode.pool.masks.values[:, slot, 10] == LOCAL).all())
    assert decode.pool.masks.summary(0, slot) == (32 - 11, 1, 10)


def test_local_spans_only_when_every_token_is_local():
    decode = DecodeEngine(LAYOUT, num_slots=1, max_tokens=32)
    decode._links.append(inproc_link()[1])  # open() needs a prefill node to address
    rid = decode.open(10, POLICIES["partial"])
    slot = decode.slot_of(rid)
    decode.pool.masks.set_local(2, slot, 0, 9)  # one token still remote
    assert decode.local_spans(2, [rid], [0], [10]) is None
    assert decode.local_spans(2, [rid], [0], [9]) is not None
    decode.pool.masks.set_local(2, slot, 9, 10)
    [(k, v)] = decode.local_spans(2, [rid], [0], [10])
    assert k.shape == (10, 2, 8) and k.data_ptr() == decode.pool.k[2, slot].data_ptr()  # a view, no copy


@pytest.fixture(scope="module")
def alone(importance):
    """Each policy's requests batched only with requests of their own scheme."""
    return {name: simulate(config(), [policy, policy], importance) for name, policy in POLICIES.items()}


@pytest.mark.parametrize("second", list(POLICIES))
@pytest.mark.parametrize("first", list(POLICIES))
def test_a_mixed_scheme_batch_treats_each_request_by_its_own_policy(first, second, importance, alone):
    mixed = simulate(config(), [POLICIES[first], POLICIES[second]], importance)
    assert mixed.mismatches == 0 and mixed.max_fetch_count <= 1 and mixed.prefill_requests_left == 0
    for position, name in enumerate((first, second)):
        got, want = mixed.requests[position], alone[name].requests[position]
        assert got["error"] is None
        # what the request attends: every selected entry, or (proactive-only) exactly its proactive set
        assert got["selected_entries"] == want["selected_entries"], (name, position)
        if POLICIES[name].drop_remote:
            assert got["fetched_tokens"] == got["remote_entries"] == 0
        else:  # what was remote was fetched (how much is remote at a step depends on when pushes land)
            assert (got["fetched_tokens"] > 0) == (got["remote_entries"] > 0)


def typed_open_meta() -> dict:
    return {"slot": 0, "length": 5, "scheme": "partial", "strategy": "profile", "speculative_ratio": 0.1}


def test_typed_messages_round_trip_and_refuse_bad_fields():
    from smartgen.engine import messages as msg
    from smartgen.lanes.base import Message, MessageKind

    positions = torch.tensor([3, 1, 4], dtype=torch.int64)
    for typed in (
        msg.Open("r", 2, 100, "smartgen", "profile", 0.1, torch.arange(5)),
        msg.Fetch("r", 3, 7, positions),
        msg.Idle("r", 4),
        msg.Abort("r", "client went away"),
        msg.FirstToken("r", 42, msg.pack_metadata([{}, {"pages": torch.ones(2)}])),
    ):
        back = msg.unpack(typed.pack())
        assert type(back) is type(typed) and back.request_id == "r"
    assert msg.unpack(msg.Fetch("r", 3, 7, positions).pack()).positions.tolist() == [3, 1, 4]
    held = torch.zeros(4, 5, dtype=torch.bool)
    held[0] = True
    again = msg.unpack(msg.Open("r", 2, 5, "partial", "profile", 0.1, torch.arange(5), held, resumed=True).pack())
    assert isinstance(again, msg.Open) and again.resumed and again.held is not None and torch.equal(again.held, held)
    assert not msg.unpack(msg.Open("r", 2, 5, "partial", "profile", 0.1).pack()).resumed
    with pytest.raises(msg.MessageError, match="'held' must be uint8"):
        msg.unpack(Message(MessageKind.OPEN, "r", {**typed_open_meta(), "length": 5}, {"held": torch.ones(4, 6)}))
    with pytest.raises(msg.MessageError, match="OPEN: missing 'scheme'"):
        msg.unpack(Message(MessageKind.OPEN, "r", {"slot": 0, "length": 5}))
    with pytest.raises(msg.MessageError, match="'layer' must be int, got str"):
        msg.unpack(Message(MessageKind.IDLE, "r", {"layer": "4"}))
    with pytest.raises(msg.MessageError, match="layer '9' of a 4-layer model"):
        msg.unpack_metadata({"9/pages": torch.ones(1)}, 4)


def test_a_policy_keeps_its_scheme_name_and_labels_its_strategy():
    policy = get_policy("smartgen", strategy="streaming")
    assert policy.name == "smartgen" and policy.label == "smartgen[streaming]" and policy.strategy == "streaming"
    assert get_policy("full").label == "full" and f"{policy.proactive}" == "budget"
    with pytest.raises(ValueError, match="unknown proactive strategy"):
        policy.with_strategy("fastest")


def test_timings_have_one_definition():
    from smartgen.engine.metrics import RequestMetrics

    metrics = RequestMetrics("r", 10, created=100.0, token_times=[100.5, 101.0, 101.25, 101.5])
    assert metrics.ctl == [0.5, 1.0, 1.25, 1.5]
    assert (metrics.ttft, metrics.ttst) == (metrics.ctl[0], metrics.ctl[1]) == (0.5, 1.0)
    assert metrics.tbt == 0.25  # mean gap after the second token


def test_query_strategy_pushes_the_blocks_the_last_query_attends_and_still_ends_all_local(importance, monkeypatch):
    """The "query" strategy keeps the profile's count per layer but picks the blocks by the prompt's last query;
    whatever it left out goes speculatively, so every block still lands exactly once."""
    # the unpaced in-process link measures a rate at which slices would bridge short gaps of blocks already sent
    # (tests/test_bridging.py), depending on timing; this test counts which blocks each slice chooses
    monkeypatch.setattr("smartgen.engine.prefill.decide.RUN_COST_S", 0.0)
    from smartgen.engine.layout import token_blocks
    from smartgen.engine.prefill import query_blocks

    planner = Planner(LAYOUT.num_layers, LAYOUT.num_blocks, importance, 1e-3, 1e-3)  # K_r above the floor
    prefill, decode, prefill_end = _engines(planner)
    spy = _Spy(prefill_end.push)
    length = 160
    try:
        rid = decode.open(length, get_policy("smartgen[query]", speculative_ratio=0.25))
        request = prefill.next_request(timeout=5)
        k, v = synthetic_kv(LAYOUT, length, seed=3)
        generator = torch.Generator().manual_seed(0)
        picked = {}
        for layer in range(LAYOUT.num_layers):
            scores = torch.rand(length, generator=generator)
            prefill.prefill_layer(rid, layer, k[layer], v[layer], scores)
            if layer >= 2:
                count = request.plan.proactive_blocks(layer).numel()
                assert 0 < count < LAYOUT.num_blocks  # a real choice to make
                per_block = torch.zeros(LAYOUT.num_blocks).scatter_reduce(
                    0, token_blocks(length, LAYOUT.num_blocks), scores, "amax", include_self=False
                )
                expected = set(torch.topk(per_block, count).indices.tolist())
                picked[layer] = set(query_blocks(scores, length, LAYOUT.num_blocks, count).tolist())
                assert picked[layer] == expected
        prefill.finish_prefill(rid, 0)
        decode.wait_first_token(rid, timeout=5)
        prefill_end.push.flush(5)
        decode.end_step([rid])  # speculation starts with the second decode step
        proactive = [ops for tag, ops in spy.batches if tag == "proactive"]
        for layer in (2, 3):
            landed = {b % LAYOUT.num_blocks for b in _blocks_of(proactive[layer], decode, request)}
            assert landed == picked[layer]
        # the prefill thread moves its cursor before it posts a slice, so the cursor says nothing about what landed:
        # wait for the cache to be whole instead
        deadline = time.monotonic() + 10
        while not decode.is_all_local(rid) and time.monotonic() < deadline:
            decode.begin_layer(2, [rid])
            time.sleep(0.002)
            spy.lane.flush(5)
        assert request.speculation_done
        flat = [b for tag, ops in spy.batches if tag == "speculative" for b in _blocks_of(ops, decode, request)]
        assert len(flat) == len(set(flat))  # nothing pushed twice
        assert len(flat) + sum(len(picked.get(layer, ())) for layer in (2, 3)) + 2 * LAYOUT.num_blocks == (
            LAYOUT.num_layers * LAYOUT.num_blocks
        )
        assert decode.is_all_local(rid)
        assert torch.equal(decode.pool.k[:, decode.slot_of(rid), :length], k)
    finally:
        decode.close()
        prefill.close()


def test_last_query_attention_is_the_best_head_per_token():
    from smartgen.runtime.prefill import last_query_attention

    generator = torch.Generator().manual_seed(0)
    query, key = torch.randn(4, 8, generator=generator), torch.randn(2, 10, 8, generator=generator)
    scores = last_query_attention(query, key, 8**-0.5)
    expected = torch.stack(
        [torch.softmax(query[h] @ key[h // 2].T * 8**-0.5, dim=-1) for h in range(4)]  # GQA: heads 0,1 -> kv 0
    ).amax(dim=0)
    assert torch.allclose(scores, expected)
    assert scores.shape == (10,)


def test_the_optimal_set_comes_with_open_and_pushes_the_most_selected_blocks(importance):
    """A request that brings a recorded run's selection counts (OPEN's `oracle_counts`) is planned with them: its
    proactive set past layers 0-1 is the blocks whose tokens those counts rank highest."""
    from smartgen.engine.layout import token_blocks

    planner = Planner(LAYOUT.num_layers, LAYOUT.num_blocks, importance, 1e-3, 1e-3)  # K_r above the floor
    prefill, decode, _ = _engines(planner)
    length = 160
    counts = torch.zeros(LAYOUT.num_layers, length, dtype=torch.int32)
    blocks = token_blocks(length, LAYOUT.num_blocks)
    favourite = {2: {3, 11}, 3: {0, 7, 15}}
    for layer, chosen in favourite.items():
        for block in chosen:
            counts[layer, blocks == block] = 5 + block  # the others stay at 0
    try:
        decode.open(length, get_policy("smartgen[optimal]"), oracle_counts=counts)
        request = prefill.next_request(timeout=5)
        budget = planner.budget(length, "budget") - 2 * LAYOUT.num_blocks
        assert budget >= 5  # room for every favourite block
        for layer, chosen in favourite.items():
            assert chosen <= set(request.plan.proactive_blocks(layer).tolist())
    finally:
        decode.close()
        prefill.close()


def test_open_refuses_oracle_counts_of_the_wrong_shape():
    from smartgen.engine.messages import MessageError, Open, unpack

    good = Open("r", 0, 10, "smartgen", "optimal", 0.1, oracle_counts=torch.ones(4, 10, dtype=torch.int32))
    assert torch.equal(unpack(good.pack()).oracle_counts, torch.ones(4, 10, dtype=torch.int32))
    for bad in (torch.ones(4, 9, dtype=torch.int32), torch.ones(4, 10), -torch.ones(4, 10, dtype=torch.int32)):
        message = good.pack()
        message.payload["oracle_counts"] = bad
        with pytest.raises(MessageError, match="oracle_counts"):
            unpack(message)


@pytest.mark.parametrize(("scheme", "expected"), [("smartgen", [0, 4]), ("smartgen-paper+hints", list(range(8)))])
def test_a_chaining_policy_sends_an_idle_notice_every_few_layers(scheme, expected):
    """The paper's notice goes out at the start of every layer; a policy that chains its slices keeps the link busy
    by itself and sends one every CHAINED_NOTICE_LAYERS layers (the first at once), each with every hint gathered
    since the last: no hint is dropped."""
    assert decode_module.CHAINED_NOTICE_LAYERS == 4
    prefill, decode, _ = _engines(Planner(LAYOUT.num_layers, LAYOUT.num_blocks, None, 1e-6, 1e-2))
    try:
        rid, _ = _prefilled(prefill, decode, get_policy(scheme, "streaming"), length=120)
        decode.end_step([rid])  # speculation starts with the second step
        request = decode._require(rid)
        sent = _record_control(request)
        layers = [2 + i % 2 for i in range(8)]  # eight layer starts over the sparse layers 2 and 3
        heads = LAYOUT.num_kv_heads  # one hinted token each, every head: entries (layer * n + token) * H + head
        hints = [(layer * 120 + i) * heads + h for i, layer in enumerate(layers) for h in range(heads)]
        # every hinted token is still remote, and stays so: the prefill node's speculation lands nothing meanwhile
        # (its pushes wait for the lane's apply lock; a streaming plan pushes these first tokens first, and a push
        # that landed between two notices took its entries out of the second)
        with request.link.push._apply_lock:
            decode.pool.masks.values[:, request.slot, :120] = REMOTE
            for i, layer in enumerate(layers):
                request.hints.append((layer, torch.full((LAYOUT.num_kv_heads, 1), i)))  # a wider pick of token i
                decode.begin_layer(layer, [rid])
        assert not request.metrics.error
        assert [m.meta["layer"] for m in sent] == [layers[i] for i in expected]
        hinted = torch.cat([Idle.unpack(m).hints for m in sent])
        assert sorted(hinted.tolist()) == sorted(hints[: (expected[-1] + 1) * heads])
    finally:
        decode.close()
        prefill.close()


def test_a_forecast_is_fetched_in_pieces_of_a_few_ms_of_link_each():
    """A joiner's forecast picks go out as several low-priority FETCHes, each of what the link moves in
    FORECAST_CHUNK_S (a running request's reply waits behind one piece, not a whole layer's picks); together they
    ask for every remote pick once, and the step that selects them asks for nothing more."""
    from smartgen.engine import messages as msg
    from smartgen.lanes.rate import bytes_per_second

    gbps = 0.001
    entry_bytes = 2 * LAYOUT.token_bytes // LAYOUT.num_kv_heads
    piece = decode_decide.forecast_chunk(entry_bytes, bytes_per_second(gbps))
    assert 1 < piece < 40
    prefill, decode, _ = _engines(Planner(LAYOUT.num_layers, LAYOUT.num_blocks, None, 1e-6, 1e-2), gbps=gbps)
    try:
        rid, _ = _prefilled(prefill, decode, get_policy("smartgen-no-second-token", "streaming"), length=120)
        request = decode._require(rid)
        decode.pool.masks.values[2, request.slot, :120] = REMOTE  # layer 2 all remote: every pick is fetched
        sent = _record_control(request)
        index = torch.arange(0, 80, 2).expand(LAYOUT.num_kv_heads, 40).contiguous()  # 40 tokens, every head
        assert decode.fetch_forecast(2, rid, index) == 80
        fetches = [msg.unpack(m) for m in sent if m.kind == msg.Fetch.KIND]
        assert len(fetches) == -(-80 // piece) and all(f.low for f in fetches)
        asked = [
            (int(p), h)
            for f in fetches
            for p, row in zip(f.positions, f.heads)
            for h in row.nonzero().flatten().tolist()
        ]
        assert len(asked) == 80 and set(asked) == {(t, h) for t in range(0, 80, 2) for h in range(LAYOUT.num_kv_heads)}
        assert all(int(f.heads.sum()) <= piece for f in fetches)
        deadline = time.monotonic() + 10
        while not decode.forecast_landed(rid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert decode.forecast_landed(rid) and not request.metrics.error
        timeline = request.metrics.timeline()  # the bench's per-request timeline: asked, then landed
        assert list(timeline)[-2:] == ["forecast_asked", "forecast_landed"]
        assert 0 <= timeline["forecast_asked"] <= timeline["forecast_landed"]
        before = len(sent)
        decode.assemble(2, [rid], index)  # the step that selects them finds them in and asks for nothing more
        assert not request.metrics.error and request.metrics.step_fetched == 0
        assert not [m for m in sent[before:] if m.kind == msg.Fetch.KIND]
    finally:
        decode.close()
        prefill.close()


def test_forecast_pieces_follow_the_link_rate():
    chunk = decode_decide.forecast_chunk
    assert chunk(256, 3.2e6) == int(3.2e6 * decode_decide.FORECAST_CHUNK_S // 256)  # 62 entries, 5 ms
    assert chunk(256, None) == decode_decide.FORECAST_CHUNK_BYTES // 256  # unpaced: 1 MiB
    assert chunk(4096, 1.0) == 1  # at least one entry


def test_a_batch_waits_for_one_members_fetches_no_longer_than_its_share_of_the_step():
    """`step_share`: none alone, before any step or switched off, else the last step's own time over the batch size.
    A member whose fetches alone hold a layer until its share is used up is held back (its rows assembled from what is
    local, counted in `deferred_steps`) while the other's layer is assembled with its fetches; in the step's later
    layers its remote picks are fetched ahead into `late`, for its redo, and waited for by no one; `undo_step` starts
    its share afresh and the member is no longer held back."""
    from smartgen.engine import messages as msg

    prefill, decode, _ = _engines(Planner(LAYOUT.num_layers, LAYOUT.num_blocks, None, 1e-6, 1e-2))
    try:
        policy = get_policy("smartgen-no-second-token", "streaming")
        slow, _ = _prefilled(prefill, decode, policy, length=120)
        fast, _ = _prefilled(prefill, decode, policy, length=120)
        requests = [decode._require(slow), decode._require(fast)]
        assert decode.step_share(requests) is None  # no step yet
        decode.note_step(0.2)
        assert decode.step_share(requests[:1]) is None and decode.step_share(requests) == pytest.approx(0.1)
        decode.share_steps = False
        assert decode.step_share(requests) is None
        decode.share_steps = True
        send = requests[0].link.control.send
        held: list = []

        def hold_slow_fetches(message, *args, **kwargs):  # the slow member's FETCHes never reach its prefill node
            if message.kind == msg.Fetch.KIND and message.request_id == slow:
                held.append(msg.unpack(message))
                return None
            return send(message, *args, **kwargs)

        requests[0].link.control.send = hold_slow_fetches  # type: ignore[method-assign]
        values = decode.pool.masks.values
        for request in requests:
            values[2:4, request.slot, :120] = REMOTE
        heads = LAYOUT.num_kv_heads
        index = torch.tensor([[4, 5]]).expand(2 * heads, 2).contiguous()  # tokens 4 and 5, every head, both
        started = time.monotonic()
        decode.assemble(2, [slow, fast], index)
        assert time.monotonic() - started < 5  # held back at its share (0.1 s), not at the 30 s fetch timeout
        assert requests[0].deferred and requests[0].held_back and decode.held_back(slow)
        assert not requests[1].deferred and not requests[1].metrics.error
        assert requests[0].metrics.deferred_steps == 1 and requests[0].step_wait_s >= 0.1
        assert (values[2, requests[1].slot, 4:6] == LOCAL).all()  # the other member's fetch landed
        assert decode.deferred([slow, fast]) == [0]
        decode.assemble(3, [slow, fast], index)  # a later layer: the held member's picks fetched ahead, unwaited
        assert [f.layer for f in held] == [2, 3]
        assert [at for at, *_ in requests[0].late] == [2, 3] and requests[0].metrics.deferred_steps == 1
        assert (values[3, requests[1].slot, 4:6] == LOCAL).all()
        decode.undo_step(slow)
        assert not requests[0].deferred and not requests[0].held_back and requests[0].step_wait_s == 0.0
    finally:
        decode.close()
        prefill.close()


def test_the_last_member_stepping_is_never_held_back_for_its_share():
    """A step must move someone: in a batch whose other member is already deferred, a member waits for its fetch
    (up to the fetch timeout) however long past its share, and is not held back."""
    import threading

    from smartgen.engine import messages as msg

    prefill, decode, _ = _engines(Planner(LAYOUT.num_layers, LAYOUT.num_blocks, None, 1e-6, 1e-2))
    try:
        policy = get_policy("smartgen-no-second-token", "streaming")
        late, other = (_prefilled(prefill, decode, policy, length=120)[0] for _ in range(2))
        requests = [decode._require(late), decode._require(other)]
        decode.note_step(0.02)  # a share of 10 ms
        requests[1].deferred = requests[1].held_back = True
        send = requests[0].link.control.send

        def delay_fetches(message, *args, **kwargs):  # this member's FETCHes leave 0.2 s late: 20 shares
            if message.kind == msg.Fetch.KIND and message.request_id == late:
                threading.Timer(0.2, send, (message, *args), kwargs).start()
                return None
            return send(message, *args, **kwargs)

        requests[0].link.control.send = delay_fetches  # type: ignore[method-assign]
        values = decode.pool.masks.values
        values[2, requests[0].slot, :120] = REMOTE
        index = torch.tensor([[4, 5]]).expand(2 * LAYOUT.num_kv_heads, 2).contiguous()
        decode.assemble(2, [late, other], index)
        assert not requests[0].deferred and requests[0].metrics.deferred_steps == 0
        assert (values[2, requests[0].slot, 4:6] == LOCAL).all()  # waited for and landed
    finally:
        decode.close()
        prefill.close()


def test_a_step_counts_the_entries_it_fetched_that_a_notice_had_hinted():
    """`step_fetched_hinted`: of the entries a step fetched for itself, those an earlier idle notice had hinted (hints
    the speculative push had not brought in time), entry by entry; a step's own fetches only."""
    prefill, decode, _ = _engines(Planner(LAYOUT.num_layers, LAYOUT.num_blocks, None, 1e-6, 1e-2))
    try:
        rid, _ = _prefilled(prefill, decode, get_policy("smartgen", "streaming"), length=120)
        decode.end_step([rid])  # notices go from the second step on
        request = decode._require(rid)
        send = request.link.control.send

        def hold_notices(message, *args, **kwargs):  # the prefill node never sees them: nothing hinted is pushed
            return None if message.kind == Idle.KIND else send(message, *args, **kwargs)

        request.link.control.send = hold_notices  # type: ignore[method-assign]
        values = decode.pool.masks.values
        values[2, request.slot, :120] = REMOTE
        heads = LAYOUT.num_kv_heads
        wide = torch.tensor([[5]] + [[-1]] * (heads - 1))  # a wider pick of token 5 in layer 2, by head 0 alone
        request.hints.append((2, wide))
        decode.begin_layer(2, [rid])
        assert request.hinted_sent is not None and int(request.hinted_sent.sum()) == 1
        assert bool(request.hinted_sent[(2 * 120 + 5) * heads])
        index = torch.tensor([[4, 5]]).expand(heads, 2).contiguous()  # tokens 4 and 5, every head
        decode.assemble(2, [rid], index)
        assert not request.metrics.error
        assert (request.metrics.step_fetched, request.metrics.step_fetched_hinted) == (2 * heads, 1)
        decode.assemble(3, [rid], index)  # layer 3: token 5 was hinted in layer 2 only
        assert request.metrics.step_fetched_hinted == 1
        assert request.metrics.snapshot()["step_fetched_hinted"] == 1
    finally:
        decode.close()
        prefill.close()


def test_prefetch_follows_the_layers_whose_last_selection_met_remote_entries():
    """A layer is prefetched in a step only when it still has remote KV and its selection (or prefetch) in the step
    before met remote entries: where hints and speculation keep a layer's picks local, a speculated selection
    would fetch nothing and only take the step's CPU."""
    prefill, decode, _ = _engines(Planner(LAYOUT.num_layers, LAYOUT.num_blocks, None, 1e-6, 1e-2))
    try:
        rid, _ = _prefilled(prefill, decode, get_policy("smartgen", "streaming"), length=120)
        slot = decode.slot_of(rid)
        values = decode.pool.masks.values
        index = torch.arange(10).expand(LAYOUT.num_kv_heads, 10).contiguous()  # [B·H, k]: tokens 0-9, every head
        values[3, slot, :10] = LOCAL  # layer 3's picks are local; the rest of it is still remote
        decode.assemble(2, [rid], index)  # meets remote entries: fetched
        decode.assemble(3, [rid], index)
        decode.end_step([rid])
        assert decode.prefetch_wanted([rid], 2)
        assert not decode.prefetch_wanted([rid], 3)  # remote KV left, but its last pick was all local
        values[3, slot, 10:20] = LOCAL
        decode.assemble(3, [rid], torch.arange(5, 25).expand(LAYOUT.num_kv_heads, 20).contiguous())  # 20-24 remote
        decode.end_step([rid])
        assert decode.prefetch_wanted([rid], 3)
        assert not decode.prefetch_wanted([rid], 2)  # not selected last step
    finally:
        decode.close()
        prefill.close()


def test_dense_layers_local_says_when_layers_0_and_1_have_landed():

    prefill, decode, prefill_end = _engines(Planner(LAYOUT.num_layers, LAYOUT.num_blocks, None, 1e-6, 1e-2))
    try:
        rid, _ = _prefilled(prefill, decode, get_policy("smartgen", "streaming"), length=120)
        prefill_end.push.flush(5)
        assert decode.dense_layers_local(rid)
        decode.pool.masks.values[1, decode.slot_of(rid), 5] = REMOTE  # cannot happen in use (local stays local):
        decode.pool.masks.forget(decode.slot_of(rid))  # so the table's memory of the local prefix is dropped
        assert not decode.dense_layers_local(rid)
        decode._require(rid).metrics.error = "gone"
        assert decode.dense_layers_local(rid)  # a failed request is let through, to fail in its step
    finally:
        decode.close()
        prefill.close()


def test_hints_and_prefetch_skip_a_layer_that_is_all_local():
    """A layer whose KV has all landed has nothing to push ahead or fetch early: asked about that layer, the engine
    wants neither the wider ranking nor the speculated selection, while another layer still remote wants both."""

    # a link far slower than prefill: K_r is the floor, so layers 2+ stay remote (no notice is sent: no speculation)
    prefill, decode, _ = _engines(Planner(LAYOUT.num_layers, LAYOUT.num_blocks, None, 1e-6, 1e-2))
    try:
        rid, _ = _prefilled(prefill, decode, get_policy("smartgen", "streaming"), length=120)
        _first_step(decode, rid)  # past the first decode step, where prefetch starts
        slot = decode.slot_of(rid)
        values = decode.pool.masks.values
        assert bool((values[2, slot, :120] == REMOTE).any()) and bool((values[3, slot, :120] == REMOTE).any())
        values[2, slot, :120] = LOCAL  # layer 2 landed whole
        assert not decode.prefetch_wanted([rid], 2) and decode.hint_factor([rid], 2) == 0
        assert decode.prefetch_wanted([rid], 3) and decode.hint_factor([rid], 3) > 0
        assert decode.prefetch_wanted([rid]) and decode.hint_factor([rid]) > 0  # any layer: the request's view
    finally:
        decode.close()
        prefill.close()


def test_remote_layers_are_scanned_once_a_step():
    """Hints and prefetch ask every layer of every step whether anything is still remote; the first ask of a step
    scans every layer in one pass and the answers hold for the step (a layer that lands meanwhile is answered
    again after `end_step`). Nothing turns LOCAL back to REMOTE in use, so a kept answer is stale only the safe
    way: a remote layer answered remote."""

    prefill, decode, _ = _engines(Planner(LAYOUT.num_layers, LAYOUT.num_blocks, None, 1e-6, 1e-2))
    try:
        rid, _ = _prefilled(prefill, decode, get_policy("smartgen", "streaming"), length=120)
        _first_step(decode, rid)
        slot = decode.slot_of(rid)
        values = decode.pool.masks.values
        values[2, slot, :120] = LOCAL
        assert decode.hint_factor([rid], 2) == 0
        assert decode.hint_factor([rid], 3) > 0  # still remote
        values[2, slot, 0] = REMOTE  # cannot happen in use; here it shows the answer is the step's scan
        decode.pool.masks.forget(slot)  # what the table saw local of the slot no longer holds (MaskTable says so)
        values[3, slot, :120] = LOCAL  # layer 3 landed during the step
        assert decode.hint_factor([rid], 2) == 0 and not decode.prefetch_wanted([rid], 2)
        assert decode.hint_factor([rid], 3) > 0 and decode.prefetch_wanted([rid], 3)  # the step's answer
        decode.end_step([rid])
        assert decode.hint_factor([rid], 3) == 0 and not decode.prefetch_wanted([rid], 3)  # scanned again
        assert decode.hint_factor([rid], 2) > 0  # the next step sees what the mask says now
    finally:
        decode.close()
        prefill.close()


def test_selection_counts_are_per_step_and_a_redone_step_counts_once():
    """A step's selections are counted when it ends (`end_step`): every (layer >= 2, token, head) entry once per
    step that selected it, the union's bytes with it. A deferred step taken back (`undo_step`) counts nothing, so
    redoing it does not count its layers twice; layers 0-1 are never counted."""
    prefill, decode, _ = _engines(Planner(LAYOUT.num_layers, LAYOUT.num_blocks, None, 1e-6, 1e-2))
    try:
        rid, _ = _prefilled(prefill, decode, get_policy("full"), length=120)
        heads = LAYOUT.num_kv_heads
        metrics = decode.metrics(rid)
        first = torch.arange(10).expand(heads, 10).contiguous()
        padded = torch.cat([torch.arange(5, 15).expand(heads, 10), torch.full((heads, 2), -1)], 1).contiguous()
        for layer in range(LAYOUT.num_layers):
            decode.assemble(layer, [rid], first)
        assert metrics.selection_counts is None and metrics.selected_union_bytes == 0  # counted when it ends
        decode.end_step([rid])
        decode.assemble(2, [rid], padded)  # a step that is taken back before it ends
        decode.undo_step(rid)
        decode.assemble(2, [rid], padded)
        decode.assemble(3, [rid], padded)
        decode.end_step([rid])
        counts = metrics.selection_counts
        assert counts is not None and counts.shape == (LAYOUT.num_layers, 120, heads)
        assert int(counts[:2].sum()) == 0
        expected = torch.zeros(120, dtype=torch.int32)
        expected[:10] += 1
        expected[5:15] += 1
        assert torch.equal(counts[2], expected.unsqueeze(1).expand(120, heads))
        assert torch.equal(counts[3], expected.unsqueeze(1).expand(120, heads))
        assert int(counts[4:].sum()) == (LAYOUT.num_layers - 4) * 10 * heads
        entry_bytes = 2 * LAYOUT.head_dim * LAYOUT.dtype.itemsize
        distinct = (LAYOUT.num_layers - 2) * 10 * heads + 2 * 5 * heads  # step 2 adds tokens 10-14 in layers 2-3
        assert metrics.selected_union_bytes == distinct * entry_bytes
        assert metrics.union_bytes_at_token[-2:] == [
            (LAYOUT.num_layers - 2) * 10 * heads * entry_bytes,
            distinct * entry_bytes,
        ]
    finally:
        decode.close()
        prefill.close()


def test_hints_noted_without_a_notice_stay_bounded_and_lose_nothing():
    """Hints are kept as noted picks until a notice reduces them; a request that gets no notice for long (a fetch
    always in flight) has its notes reduced in place past 2L layers' worth, keeping every hinted entry."""

    prefill, decode, _ = _engines(Planner(LAYOUT.num_layers, LAYOUT.num_blocks, None, 1e-6, 1e-2))
    try:
        rid, _ = _prefilled(prefill, decode, get_policy("smartgen", "streaming"), length=120)
        slot, heads = decode.slot_of(rid), LAYOUT.num_kv_heads
        decode.pool.masks.values[:, slot, :120] = REMOTE
        request = decode._requests[rid]
        notes = 3 * LAYOUT.num_layers
        for i in range(notes):
            decode.hint(2 + i % 2, [rid], torch.tensor([[i % 100, 100 + i % 3]]).expand(heads, 2).contiguous())
            assert len(request.hints) <= 2 * LAYOUT.num_layers + 1
        hinted = decode._hinted(request)
        expected = {
            ((2 + i % 2) * 120 + t) * heads + h
            for i in range(notes)
            for t in (i % 100, 100 + i % 3)
            for h in range(heads)
        }
        assert hinted is not None and set(hinted.tolist()) == expected
    finally:
        decode.close()
        prefill.close()


def test_a_prefill_node_lost_after_a_steps_failure_check_leaves_the_step_whole(importance):
    """The link's thread may fail a request at any moment: after the driver asked `failed` and before it ended the
    step, the step's token still counts and the request finishes or leaves at the next check. `end_step` raised
    here once, which crashed the decode node's scheduler for good (every later request hung)."""
    planner = Planner(LAYOUT.num_layers, LAYOUT.num_blocks, importance, 1e-4, 1e-3)  # slow: layers 2+ speculate
    prefill, decode, prefill_end = _engines(planner)
    try:
        # speculation starts after the first step: layers past 0-1 are still remote when the link goes
        rid, _ = _prefilled(prefill, decode, get_policy("smartgen-paper", speculative_ratio=0.1))
        index = torch.arange(0, 4).expand(LAYOUT.num_kv_heads, 4).contiguous()
        for layer in range(2, LAYOUT.num_layers):
            decode.assemble(layer, [rid], index)
        assert decode.failed([rid]) == []  # the driver's check: all well
        prefill_end.close()  # then the prefill node dies before the step ends
        _wait(lambda: decode.failed([rid]) == [0])
        tokens = len(decode.metrics(rid).token_times)
        decode.end_step([rid])
        assert len(decode.metrics(rid).token_times) == tokens + 1
        assert decode.release_fully_local([rid]) == []  # nothing is released on a lost link
        decode.finish(rid)
        assert decode.pool.num_free == 2 and not decode.has_request(rid)
    finally:
        decode.close()
        prefill.close()


def test_a_batch_appends_its_tokens_as_one_request_at_a_time_would():
    """`append_batch` (one write per tensor for the whole batch) leaves the pool, masks and lengths exactly as
    `append` per request does, and a full slot refuses the batch before any length moves."""
    from smartgen.engine.pool import PoolFull

    pools = [DecodePool(LAYOUT, num_slots=3, max_tokens=6) for _ in range(2)]
    for pool in pools:
        pool.allocate(2)
        pool.allocate(4)
        pool.allocate(3)
    slots = [2, 0]  # not in slot order: row b is slots[b]'s
    for _ in range(2):  # two tokens
        for layer in range(LAYOUT.num_layers):
            k = torch.randn(len(slots), LAYOUT.num_kv_heads, LAYOUT.head_dim)
            v = torch.randn_like(k)
            for b, slot in enumerate(slots):
                pools[0].append(layer, slot, k[b], v[b])
            pools[1].append_batch(layer, slots, k, v)
    one, batch = pools
    assert one.lengths == batch.lengths == [4, 4, 5]
    assert torch.equal(one.k, batch.k) and torch.equal(one.v, batch.v)
    assert torch.equal(one.masks.values, batch.masks.values)
    assert (batch.masks.values[:, 2, 3:5] == LOCAL).all()
    batch.append_batch(0, [0], torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))
    batch.append_batch(0, [0], torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))
    with pytest.raises(PoolFull):
        batch.append_batch(0, [1, 0], torch.zeros(2, 2, 8), torch.zeros(2, 2, 8))
    assert batch.lengths == [6, 4, 5]


def test_a_layer_that_fetches_nothing_is_gathered_in_one_call(importance, monkeypatch):
    """Full transfer's layers (all local) and a sequential policy's layers with nothing remote are read in one
    gather, as a parallel request's are; the gather before the fetches and the one after them are only for a layer
    that fetches. The entries attended are the true ones either way (`test_every_policy_assembles_the_true_kv`)."""
    import smartgen.engine.decode.move as move_module

    calls = {"valid": 0, "split": 0}

    def counting(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(move_module, "gather_valid", counting("valid", move_module.gather_valid))
    monkeypatch.setattr(move_module, "gather_kv", counting("split", move_module.gather_kv))
    result = simulate(config(), POLICIES["full"], importance)
    assert result.mismatches == 0 and all(r["error"] is None for r in result.requests)
    assert calls["valid"] > 0 and calls["split"] == 0
    calls.update(valid=0, split=0)
    result = simulate(config(), POLICIES["partial"], importance)  # sequential, and its first steps fetch
    assert result.mismatches == 0 and calls["split"] > 0


def test_a_requests_timeline_keeps_each_milestones_first_time_and_each_tokens_link_wait():
    from smartgen.engine.metrics import RequestMetrics

    metrics = RequestMetrics("r", 10, created=100.0)
    metrics.record_token(100.5)  # the prefill node's token: no wait
    metrics.mark("dense_local", 100.7)
    metrics.mark("joined", 100.9)
    metrics.mark("dense_local", 101.5)  # seen again later: the first time stays
    metrics.count_fetch_wait(0.25)
    metrics.count_fetch_wait(0.05)  # two waits in one step
    metrics.record_token(101.2)
    metrics.record_token(101.4)
    assert metrics.timeline() == pytest.approx({"dense_local": 0.7, "joined": 0.9})
    assert list(metrics.timeline()) == ["dense_local", "joined"]
    assert metrics.token_waits == pytest.approx([0.0, 0.3, 0.0])


def test_a_fetchs_round_trip_ends_at_its_replys_arrival_and_steps_count_their_waits_by_kind():
    """A prefetch's reply may wait in `late` until the step reaches its layer: its round trip (`fetches.<kind>`) is
    counted to the reply's arrival, not to that landing; a step's waits for replies are counted by the kind of
    reply waited for (`waited`): here its own fetch's, none for the prefetch that had arrived."""
    prefill, decode, _ = _engines(Planner(LAYOUT.num_layers, LAYOUT.num_blocks, None, 1e-6, 1e-2), gbps=0.01)
    try:
        rid, _ = _prefilled(prefill, decode, get_policy("smartgen-no-second-token", "streaming"), length=120)
        request = decode._require(rid)
        values = decode.pool.masks.values
        values[2, request.slot, :120] = REMOTE
        heads = LAYOUT.num_kv_heads
        ahead = torch.tensor([4 * heads + h for h in range(heads)])  # token 4, every head: asked a layer ahead
        request.late.append((2, ahead, decode._send_fetch(request, 2, ahead, "prefetch"), time.monotonic()))
        time.sleep(0.3)  # its reply arrives meanwhile; the step lands it only when it reaches layer 2
        index = torch.tensor([[4, 5]]).expand(heads, 2).contiguous()  # tokens 4 (asked ahead) and 5 (not)
        decode.assemble(2, [rid], index)
        assert (values[2, request.slot, 4:6] == LOCAL).all()
        fetches = decode.counters.snapshot()["fetches"]
        assert fetches["prefetch"]["landed"] == 1 and fetches["step"]["landed"] == 1
        assert fetches["prefetch"]["seconds"] < 0.25  # to its arrival, not to the landing 0.3 s later
        assert fetches["step"]["waited"] > 0 and fetches["prefetch"]["waited"] < 0.05
        assert fetches["forecast"] == {"landed": 0, "seconds": 0.0, "waited": 0.0}
    finally:
        decode.close()
        prefill.close()
