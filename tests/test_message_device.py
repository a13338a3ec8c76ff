"""A decode node on a GPU gets every tensor a message brings (metadata, forecast queries, the second token's K/V)
on its pool's device: lanes decode them into host memory, and the step selects with them beside the pool.

The pool here is on the meta device, which only records where a tensor lives: the CPU tensors of a message must
end up there, as they must end up on cuda:0 for a node on a GPU (the TCP lane's first run on one failed in Quest's
page bounds: cuda:0 queries against host metadata).
"""

from __future__ import annotations

import torch

from smartgen.engine import messages as msg
from smartgen.engine.decode import DecodeEngine
from smartgen.engine.layout import KVLayout
from smartgen.engine.policy import POLICIES
from smartgen.lanes.link import inproc_link

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32, num_blocks=4)


def _opened() -> tuple[DecodeEngine, str]:
    engine = DecodeEngine(LAYOUT, num_slots=1, max_tokens=32, device="meta")
    engine._links.append(inproc_link()[1])  # open() needs a prefill node to address
    return engine, engine.open(10, POLICIES["smartgen"])


def test_metadata_and_first_token_metadata_land_on_the_pool_device():
    engine, rid = _opened()
    engine._handle(msg.Metadata(rid, 2, {"page_max": torch.ones(2, 4, 8), "page_min": torch.zeros(2, 4, 8)}))
    engine._handle(msg.FirstToken(rid, 5, msg.pack_metadata([{"page_max": torch.ones(2, 4, 8)}, {}, {}])))
    metadata = engine.request_metadata(rid)
    assert {name: t.device.type for name, t in metadata[2].items()} == {"page_max": "meta", "page_min": "meta"}
    assert metadata[0]["page_max"].device.type == "meta"
    assert engine._requests[rid].first_token.result() == 5


def test_forecast_queries_and_second_token_land_on_the_pool_device():
    engine, rid = _opened()
    engine._handle(msg.FirstToken(rid, 5, {}, forecast=True))
    second = msg.SecondToken(7, torch.ones(3, 2, 8), torch.ones(3, 2, 8))
    engine._handle(msg.Forecast(rid, {2: torch.ones(4, 8)}, second))
    engine._handle(msg.Forecast(rid, {2: torch.ones(4, 8)}, step=2))
    request = engine._requests[rid]
    assert request.forecast is not None and request.forecast[2].device.type == "meta"
    assert request.forecast_next is not None and request.forecast_next[2].device.type == "meta"
    assert request.second is not None and request.second.token == 7
    assert (request.second.keys.device.type, request.second.values.device.type) == ("meta", "meta")


def test_on_the_cpu_the_tensors_are_the_messages_own():
    engine = DecodeEngine(LAYOUT, num_slots=1, max_tokens=32)
    engine._links.append(inproc_link()[1])
    rid = engine.open(10, POLICIES["smartgen"])
    page_max = torch.ones(2, 4, 8)
    engine._handle(msg.Metadata(rid, 2, {"page_max": page_max}))
    assert engine.request_metadata(rid)[2]["page_max"] is page_max  # no copy where none is needed


def test_the_second_token_is_in_place_before_the_forecast_shows(monkeypatch):
    """The driver takes the second token as soon as `forecast_pending` turns False, on its own thread: the FORECAST's
    queries must become visible after its second token, or the driver finds none and decodes the second itself
    (seen under load: one request in a batch with prefill_tokens 1)."""
    engine, rid = _opened()
    engine._handle(msg.FirstToken(rid, 5, {}, forecast=True))
    request = engine._requests[rid]
    seen = []
    here = engine._here

    def watching(tensors):
        moved = here(tensors)
        seen.append((request.second is not None, request.forecast is None))
        return moved

    monkeypatch.setattr(engine, "_here", watching)
    engine._handle(
        msg.Forecast(rid, {2: torch.ones(4, 8)}, msg.SecondToken(7, torch.ones(3, 2, 8), torch.ones(3, 2, 8)))
    )
    assert seen == [(True, True)]  # the queries were placed with the second token already there
    assert not engine.forecast_pending(rid) and request.second is not None and request.second.token == 7
