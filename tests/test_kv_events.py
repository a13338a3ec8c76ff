"""KV events in vLLM's format: the bytes match msgspec's encoding of vLLM's own structs, the publisher's PUB and replay
sockets, and a real node whose events, replayed, add up to the blocks its /status says it holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

zmq = pytest.importorskip("zmq", reason="KV events need pyzmq (pip install 'smartgen[events]')")
msgspec = pytest.importorskip("msgspec", reason="the vLLM-side decoder in these tests is msgspec's")

import torch  # noqa: E402
from conftest import get_json, wait_until  # noqa: E402
from tiny_models import save_tiny_model  # noqa: E402

from smartgen.engine.cache_events import AllCleared, BlocksRemoved, BlocksStored  # noqa: E402
from smartgen.engine.prefix_cache import PrefixCache  # noqa: E402
from smartgen.roles.colocated import DecodeSettings  # noqa: E402
from smartgen.roles.kv_events import (  # noqa: E402
    END_SEQ,
    KvEventPublisher,
    KvEventsSettings,
    block_hash,
    encode_batch,
    events_problem,
)
from smartgen.roles.launch import NodeSettings  # noqa: E402
from smartgen.roles.node_runner import start_node  # noqa: E402
from smartgen.roles.serve_settings import ServeSettings  # noqa: E402
from smartgen.runtime.models import kv_layout, load_model  # noqa: E402


# -- vLLM's structs, as vllm/distributed/kv_events.py declares them --------------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


# up to vLLM 0.23 every event is a tagged array (array_like); each release appended fields to BlockStored
class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldStored(ArrayEvent, tag="BlockStored"):  # vLLM 0.10-0.11 (its example subscriber): six fields
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class LoraStored(OldStored, tag="BlockStored"):  # then lora_name: what our array encoding is, byte for byte
    lora_name: str | None


class BlockStored(LoraStored, tag="BlockStored"):  # then fields with defaults (a shorter array leaves them so)
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class LoraRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class BlockRemoved(LoraRemoved, tag="BlockRemoved"):
    group_idx: int | None = None


class AllBlocksCleared(ArrayEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class LoraBatch(EventBatch):
    events: list[LoraStored | LoraRemoved | AllBlocksCleared]


class OldBatch(EventBatch):
    events: list[OldStored | BlockRemoved | AllBlocksCleared]


# since vLLM's #42892: events are tagged maps with the same fields (the batch stays an array)
class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapStored(MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None


class MapRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class MapCleared(MapEvent, tag="AllBlocksCleared"):
    pass


class MapBatch(EventBatch):
    events: list[MapStored | MapRemoved | MapCleared]


KEY_A, KEY_B = bytes(range(16)), bytes(range(100, 116))
OURS = [
    AllCleared(),
    BlocksStored([KEY_A, KEY_B], None, list(range(8)), 4, "CPU"),
    BlocksRemoved([KEY_B], "CPU"),
]


def test_our_batches_are_the_bytes_msgspec_makes_of_vllm_s_own_structs():
    a, b = block_hash(KEY_A), block_hash(KEY_B)
    assert a == int.from_bytes(KEY_A[:8], "big") and 0 <= b < 2**64
    theirs = LoraBatch(
        1.5,
        [AllBlocksCleared(), LoraStored([a, b], None, list(range(8)), 4, None, "CPU", None), LoraRemoved([b], "CPU")],
        0,
    )
    assert encode_batch(1.5, OURS, "array") == msgspec.msgpack.encode(theirs)
    # later array-era classes add fields with defaults at the end: a shorter array leaves them at their defaults
    latest = msgspec.msgpack.Decoder(KVEventBatch).decode(encode_batch(1.5, OURS, "array"))
    assert latest.events[1] == BlockStored([a, b], None, list(range(8)), 4, None, "CPU", None)
    as_maps = MapBatch(
        1.5, [MapCleared(), MapStored([a, b], None, list(range(8)), 4, None, "CPU", None), MapRemoved([b], "CPU")], 0
    )
    assert encode_batch(1.5, OURS, "map") == msgspec.msgpack.encode(as_maps)


def test_each_vllm_generation_s_decoder_reads_the_encoding_made_for_it():
    old = msgspec.msgpack.Decoder(OldBatch).decode(encode_batch(2.0, OURS, "array"))
    assert old.ts == 2.0 and old.data_parallel_rank == 0
    stored = old.events[1]
    assert isinstance(stored, OldStored) and stored.block_size == 4 and stored.token_ids == list(range(8))
    assert isinstance(old.events[0], AllBlocksCleared) and isinstance(old.events[2], BlockRemoved)
    new = msgspec.msgpack.Decoder(MapBatch).decode(encode_batch(2.0, OURS, "map"))
    assert isinstance(new.events[1], MapStored) and new.events[1].parent_block_hash is None


def test_settings_problems_name_the_option():
    assert events_problem(KvEventsSettings("tcp://*:5557")) is None
    assert "--kv-events-encoding" in events_problem(KvEventsSettings("tcp://*:5557", encoding="json"))
    assert "--kv-events-endpoint" in events_problem(KvEventsSettings("localhost:5557"))
    assert "--kv-events-replay" in events_problem(KvEventsSettings("tcp://*:5557", "5558"))
    assert events_problem(KvEventsSettings("tcp://*:5557", "tcp://127.0.0.1:5558")) is None  # bound, as vLLM's


# -- the publisher ----------------------------------------------------------------------------------------------
def replay(endpoint: str, start: int = 0) -> list[tuple[int, bytes]]:
    """What a subscriber gets back for `start`: (seq, payload) until the end marker. A DEALER reads every reply of
    the ROUTER's stream (a REQ socket, as in vLLM's example, keeps only the first)."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])  # as a REQ socket frames it
        got: list[tuple[int, bytes]] = []
        while True:
            assert dealer.poll(5000), "no replay answer within 5 s"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                return got
            got.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close()
        context.term()


def at_least(n: int, batches: list[tuple[int, bytes]]) -> list[tuple[int, bytes]] | None:
    return batches if len(batches) >= n else None


def held_after(batches: list[tuple[int, bytes]], decoder: Any = None) -> tuple[set[int], int, int]:
    """The block hashes a subscriber holds after applying `batches` in order, and the stored and removed counts."""
    decoder = decoder or msgspec.msgpack.Decoder(KVEventBatch)
    held: set[int] = set()
    stored = removed = 0
    for _, payload in batches:
        for event in decoder.decode(payload).events:
            if isinstance(event, BlockStored):
                assert event.parent_block_hash is None or event.parent_block_hash in held, (
                    "stored under an unknown parent"
                )
                held.update(event.block_hashes)
                stored += len(event.block_hashes)
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= held
                held.difference_update(event.block_hashes)
                removed += len(event.block_hashes)
            else:
                held.clear()
    return held, stored, removed


def test_a_publisher_sends_the_cache_s_changes_live_and_replays_them_in_order():
    publisher = KvEventPublisher(KvEventsSettings("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv"))
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    try:
        sub.connect(publisher.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        wait_until(lambda: replay(publisher.replay_endpoint), 5, "the first batch (AllBlocksCleared)")
        cache = PrefixCache(2 * 2 * 4 * 4, 4)  # two blocks of one float a token
        cache.set_listener(publisher.listener)
        kv = torch.zeros(1, 12, 1, 1)
        cache.insert(list(range(12)), kv, kv)  # 3 blocks for 2 places: one stored run, then a removal
        cache.insert(list(range(50, 58)), kv[:, :8], kv[:, :8])
        batches = wait_until(lambda: at_least(3, replay(publisher.replay_endpoint)), 5, "3 batches")
        assert [seq for seq, _ in batches] == list(range(len(batches)))
        held, stored, removed = held_after(batches)
        assert stored - removed == len(held) == cache.num_blocks == 2
        assert set(held) == {block_hash(key) for key in cache._blocks}
        assert replay(publisher.replay_endpoint, start=2) == batches[2:]
        live = []
        while sub.poll(1000):  # what arrived after the subscription took hold
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            live.append((int.from_bytes(seq, "big"), payload))
        assert live and all(item in batches for item in live)
    finally:
        sub.close()
        context.term()
        publisher.close()


# -- a real node -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tinym")


def test_a_node_s_events_add_up_to_the_blocks_its_status_reports(model_dir: Path):
    import httpx

    block = 16
    block_bytes = kv_layout(load_model(model_dir, torch.float32, "cpu")).kv_bytes(block)
    events = KvEventsSettings("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    node = NodeSettings(
        model_dir,
        blocks=16,
        lane="inproc",
        prefix_cache_bytes=6 * block_bytes,  # six blocks: four prompts of three blocks each must evict
        prefix_block_tokens=block,
        prefix_retention="cost",
        kv_events=events,
    )
    settings = ServeSettings("both", node, http="127.0.0.1:0", decode=DecodeSettings(max_tokens=256))
    running = start_node(settings, say=lambda line: None)
    try:
        url = f"http://{running.addresses['http']}"
        replay_at = running.addresses["kv_events_replay"]
        assert running.addresses["kv_events"].startswith("tcp://127.0.0.1:")
        prompts = [[3 + (i * 7 + j) % 90 for j in range(3 * block + 5)] for i in range(4)]
        for prompt in prompts + prompts[:1]:  # the last one finds its prefix (where the policy kept it)
            body = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True}
            assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200

        def settled() -> Any:
            cache = get_json(url + "/status")["prefix_cache"]
            held, stored, removed = held_after(replay(replay_at))
            if stored != cache["inserted_blocks"] or removed != cache["evicted_blocks"]:
                return None  # a batch still on its way
            return cache, held, stored, removed

        cache, held, stored, removed = wait_until(settled, 10, "the events to catch up with /status")
        assert cache["retention"]["name"] == "cost"
        published = get_json(url + "/status")["kv_events"]
        assert published["endpoint"] == running.addresses["kv_events"] and published["replay_endpoint"] == replay_at
        assert published["batches"] > 0 and published["dropped_batches"] == 0
        assert removed > 0 and stored - removed == len(held) == cache["blocks"]
        windows = {tuple(p[i : i + block]) for p in prompts for i in range(0, 3 * block, block)}
        for _, payload in replay(replay_at):
            for event in msgspec.msgpack.Decoder(KVEventBatch).decode(payload).events:
                if isinstance(event, BlockStored):
                    assert event.medium == "CPU" and event.block_size == block
                    tokens = event.token_ids
                    assert all(tuple(tokens[i : i + block]) in windows for i in range(0, len(tokens), block))
    finally:
        running.stop()


def test_a_prefill_node_publishes_too_and_starts_by_clearing(model_dir: Path):
    events = KvEventsSettings("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", encoding="map")
    node = NodeSettings(model_dir, blocks=16, prefix_cache_bytes=2**20, kv_events=events)
    settings = ServeSettings("prefill", node, listen="127.0.0.1:0", insecure=True)
    running = start_node(settings, say=lambda line: None)
    try:
        batches = wait_until(lambda: replay(running.addresses["kv_events_replay"]), 5, "the first batch")
        first = msgspec.msgpack.Decoder(MapBatch).decode(batches[0][1])
        assert batches[0][0] == 0 and [type(e) for e in first.events] == [MapCleared]
        assert running.prefill is not None
        assert running.prefill.snapshot()["kv_events"]["endpoint"] == running.addresses["kv_events"]
    finally:
        running.stop()
