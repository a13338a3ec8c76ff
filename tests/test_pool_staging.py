"""A decode pool staged through host memory: lanes land in host mirrors and a landing mask, and the decoder sees an
entry only once `sync_staged` (or `entries_landed`) has copied it into K and V and then marked the mask table.

The pool here is on the CPU (no GPU on these machines): staging does not care where K and V live, so the same
copies and the same ordering run; only the device copy itself is untested here.
"""

from dataclasses import replace

import pytest
import torch
from conftest import lane_params
from test_engine import LAYOUT as E2E_LAYOUT
from test_engine import config as engine_config

from smartgen.apps.simulate import SimulationConfig, calibrate, simulate
from smartgen.apps.synthetic import SyntheticTrace
from smartgen.engine.layout import KVLayout
from smartgen.engine.mask import LOCAL, REMOTE
from smartgen.engine.policy import POLICIES
from smartgen.engine.pool import DecodePool
from smartgen.lanes.rdma import lane as rdma_lane
from smartgen.lanes.rdma.gpu_memory import GpuDirect
from smartgen.roles.decode_node import staged_pool

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32, num_blocks=4)
HEADS, DIM = LAYOUT.num_kv_heads, LAYOUT.head_dim


def _land(pool: DecodePool, layer: int, slot: int, token: int, heads: list[int], value: float) -> None:
    """What a one-sided lane does: the token's K and V into the registered regions, then its heads' mask bytes."""
    views, geometry = pool.byte_views(), pool.geometry
    row = torch.full((HEADS, DIM), value, dtype=LAYOUT.dtype).view(-1).view(torch.uint8)
    at = geometry.kv_offset(layer, slot, token)
    views["k"][at : at + row.numel()] = row
    views["v"][at : at + row.numel()] = row + 0  # same bits: V checks the same copy path
    for head in heads:
        views["mask"][geometry.mask_offset(layer, slot, token) + head] = LOCAL


def test_a_landed_entry_is_invisible_until_synced_then_local_with_its_data():
    pool = DecodePool(LAYOUT, num_slots=2, max_tokens=8, staged=True)
    slot = pool.allocate(6)
    _land(pool, 1, slot, 3, heads=[0, 1], value=2.5)
    _land(pool, 1, slot, 4, heads=[1], value=7.0)  # only head 1 of token 4 has landed
    assert not bool(pool.k.any()) and not bool(pool.v.any())
    assert int((pool.masks.values == LOCAL).sum()) == 0, "the decoder's table knows nothing of it yet"
    assert pool.sync_staged(0, [slot]) == 0, "another layer: nothing moves"
    assert pool.sync_staged(1, [slot]) == 3
    assert torch.equal(pool.k[1, slot, 3], torch.full((HEADS, DIM), 2.5))
    assert torch.equal(pool.v[1, slot, 4, 1], torch.full((DIM,), 7.0))
    assert not bool(pool.k[1, slot, 4, 0].any()), "a head whose mask did not land is not copied"
    assert pool.masks.values[1, slot, 3].tolist() == [LOCAL, LOCAL]
    assert pool.masks.values[1, slot, 4].tolist() == [REMOTE, LOCAL]
    assert pool.sync_staged(1, [slot]) == 0, "synced once: nothing new"


def test_sync_of_every_layer_moves_only_the_slots_asked_for():
    pool = DecodePool(LAYOUT, num_slots=3, max_tokens=8, staged=True)
    a, b = pool.allocate(5), pool.allocate(5)
    for layer in range(LAYOUT.num_layers):
        _land(pool, layer, a, 0, heads=[0, 1], value=1.0 + layer)
        _land(pool, layer, b, 2, heads=[0, 1], value=9.0)
    assert pool.sync_staged(None, [a]) == LAYOUT.num_layers * HEADS
    assert all(pool.masks.tokens_local(layer, a, 0, 1).item() for layer in range(LAYOUT.num_layers))
    assert int((pool.masks.values[:, b] == LOCAL).sum()) == 0 and not bool(pool.k[:, b].any())
    assert pool.sync_staged(None, []) == 0
    assert pool.sync_staged(2, [a, b]) == HEADS


def test_generated_tokens_and_fetched_entries_are_local_at_once_and_never_overwritten_by_a_sync():
    pool = DecodePool(LAYOUT, num_slots=1, max_tokens=8, staged=True)
    slot = pool.allocate(4, max_new_tokens=2)
    entries = torch.tensor([1 * HEADS + 0, 2 * HEADS + 1])
    pool.write_entries(0, slot, entries, torch.full((2, DIM), 3.0), torch.full((2, DIM), 4.0))
    assert pool.masks.values[0, slot].view(-1)[entries].tolist() == [LOCAL, LOCAL]
    _land(pool, 0, slot, 1, heads=[0, 1], value=5.0)  # a late push of token 1: head 0 is local already
    assert pool.sync_staged(0, [slot]) == 1
    assert torch.equal(pool.k[0, slot, 1, 0], torch.full((DIM,), 3.0)), "a LOCAL entry is never rewritten"
    assert torch.equal(pool.k[0, slot, 1, 1], torch.full((DIM,), 5.0))
    position = pool.append(0, slot, torch.ones(HEADS, DIM), torch.ones(HEADS, DIM))
    assert position == 4 and pool.masks.values[0, slot, 4].tolist() == [LOCAL, LOCAL]


@pytest.mark.parametrize("staged", [False, True])
def test_entries_landed_in_the_registered_regions_become_local(staged):
    pool = DecodePool(LAYOUT, num_slots=1, max_tokens=8, staged=staged)
    slot = pool.allocate(6)
    views, geometry = pool.byte_views(), pool.geometry
    entries = torch.tensor([2 * HEADS + 1, 5 * HEADS + 0])  # (token 2, head 1), (token 5, head 0)
    k_region = views["k"].view(LAYOUT.dtype).view(pool.k.shape)
    for entry, value in zip(entries.tolist(), (6.0, 8.0)):
        k_region[1, slot, entry // HEADS, entry % HEADS] = value  # a fetch reply scattered in place by the lane
    pool.entries_landed(1, slot, entries)
    assert pool.masks.values[1, slot].view(-1)[entries].tolist() == [LOCAL, LOCAL]
    assert torch.equal(pool.k[1, slot, 2, 1], torch.full((DIM,), 6.0))
    assert torch.equal(pool.k[1, slot, 5, 0], torch.full((DIM,), 8.0))
    assert int((pool.masks.values == LOCAL).sum()) == 2
    mask = views["mask"][geometry.mask_offset(1, slot, 0) : geometry.mask_offset(1, slot, 6)].view(6, HEADS)
    if staged:  # both masks say so: a later sync has nothing to move
        assert mask[2, 1] == LOCAL and mask[5, 0] == LOCAL and pool.sync_staged(1, [slot]) == 0


def test_free_and_allocate_again_reset_the_landing_mask():
    pool = DecodePool(LAYOUT, num_slots=1, max_tokens=8, staged=True)
    slot = pool.allocate(6)
    _land(pool, 2, slot, 0, heads=[0, 1], value=1.0)
    pool.free(slot)
    assert pool.allocate(3) == slot
    assert pool.sync_staged(None, [slot]) == 0, "what landed for the last request is not the new one's"
    landing = pool.byte_views()["mask"].view(torch.int8).view(pool.masks.values.shape)[:, slot]
    assert bool((landing[:, :3] == REMOTE).all()) and not bool(landing[:, 3:].any())


def test_staged_views_are_the_host_mirrors_and_the_landing_mask():
    plain, staged = DecodePool(LAYOUT, 1, 8), DecodePool(LAYOUT, 1, 8, staged=True)
    views = staged.byte_views()
    assert set(views) == set(plain.byte_views())
    for name, own in (("k", staged.k), ("v", staged.v), ("mask", staged.masks.values)):
        assert views[name].data_ptr() != own.data_ptr() and views[name].numel() == own.numel() * own.element_size()
    assert views["quant"].device.type == "cpu" and views["quant_ready"].device.type == "cpu"


def test_staging_is_decided_by_the_pools_device_and_the_lanes_transport(monkeypatch):
    cuda = torch.device("cuda", 0)
    assert not staged_pool("tcp", cuda) and not staged_pool("inproc", cuda), "they copy into device regions"
    assert not staged_pool("mooncake", torch.device("cpu"))
    assert staged_pool("mooncake", cuda) and staged_pool("nixl", cuda), "their CUDA builds are not verified here"
    monkeypatch.setattr(rdma_lane, "gpudirect_status", lambda index=0: GpuDirect(("peer-memory",), "loaded"))
    assert not staged_pool("rdma", cuda)
    monkeypatch.setattr(rdma_lane, "gpudirect_status", lambda index=0: GpuDirect((), "none"))
    assert staged_pool("rdma", cuda)


# -- end to end: the engine on a staged pool assembles the true KV, bit for bit ---------------
def _config(**overrides) -> SimulationConfig:
    """test_engine's synthetic run (4 layers, 2 requests, a paced link) with a staged pool."""
    return engine_config(**{"staged": True, **overrides})


@pytest.fixture(scope="module")
def importance():
    cfg = _config()
    return calibrate(cfg, SyntheticTrace(E2E_LAYOUT.num_layers, E2E_LAYOUT.num_kv_heads, ratio=cfg.select_ratio))


@pytest.mark.parametrize("lane", lane_params("inproc", "tcp"))
@pytest.mark.parametrize("name", ["smartgen", "full", "partial", "proactive-only"])
def test_a_staged_pool_assembles_the_true_kv(name, lane, importance, remote_read_guard):
    policy = POLICIES[name]
    result = simulate(_config(transport=lane), policy, importance)
    assert result.mismatches == 0, "assembled KV must equal the selected ground truth bit for bit"
    assert remote_read_guard == [], "an entry was read from the pool while its mask said remote"
    assert result.max_fetch_count <= 1, "an entry was fetched twice"
    assert result.prefill_requests_left == 0 and all(r["error"] is None for r in result.requests)
    if policy.speculative or policy.wait_for_all:
        assert result.all_local and result.pool_equals_prefill


def test_a_staged_pool_lands_quantized_layers():
    result = simulate(_config(lengths=(90,), steps=3), POLICIES["quant2"])
    assert result.mismatches == 0 and result.all_local and result.pool_equals_prefill


def test_a_staged_pool_waits_for_pushed_layers_like_a_plain_one(importance):
    """On a slow link layers 0-1 are still on their way when decoding starts: the wait for them must see what lands
    (synced as it polls), else it runs to the fetch timeout and fetches every pushed entry again."""
    slow = _config(gbps=0.01, steps=3)
    staged = simulate(slow, POLICIES["partial"], importance)
    plain = simulate(replace(slow, staged=False), POLICIES["partial"], importance)
    assert staged.mismatches == 0 and all(r["error"] is None for r in staged.requests)
    assert staged.path_bytes == plain.path_bytes
