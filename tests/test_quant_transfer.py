"""Quantized full transfer (`quant2`): the wire format equals the reference, and the engine moves packed bytes only."""

import pytest
import torch

from smartgen.apps.simulate import SimulationConfig, simulate
from smartgen.apps.synthetic import synthetic_kv
from smartgen.engine.kv_quant import SERVING_QUANT, KVQuantConfig, pack_layer, packed_layer_bytes, unpack_layer
from smartgen.engine.kv_quant import quantize_kv as reference
from smartgen.engine.layout import KVLayout
from smartgen.engine.policy import POLICIES, get_policy
from smartgen.engine.pool import DecodePool


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tinym")


def _kv(n, heads=2, dim=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, heads, dim, generator=g) * torch.linspace(0.1, 4, dim)
    v = torch.randn(n, heads, dim, generator=g)
    return k.to(dtype), v.to(dtype)


@pytest.mark.parametrize(
    "n,bits,group,residual,dtype",
    [
        (300, 2, 32, 128, torch.float32),
        (300, 2, 32, 128, torch.bfloat16),
        (37, 2, 32, 128, torch.float32),  # all residual
        (100, 4, 8, 5, torch.float32),
        (130, 1, 16, 0, torch.float16),
        (64, 8, 32, 0, torch.float32),
        (1, 2, 32, 0, torch.float32),
    ],
)
def test_unpacked_layer_equals_the_reference_exactly(n, bits, group, residual, dtype):
    cfg = KVQuantConfig(bits=bits, group=group, residual=residual)
    k, v = _kv(n, dtype=dtype)
    packed = pack_layer(k, v, cfg)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_layer_bytes(n, 2, 16, dtype, cfg)
    k_hat, v_hat = unpack_layer(packed, n, 2, 16, dtype, cfg)
    k_ref, v_ref = reference(k, v, cfg)
    assert torch.equal(k_hat, k_ref) and torch.equal(v_hat, v_ref)


def test_packed_bytes_are_what_kivi_stores():
    # 2,048 fp32 tokens: codes 1/16, fp16 scale and zero 1/32, the 128-token residual 1/16 of the fp32 layer
    fp32 = 2048 * 2 * 2 * 32 * 4
    assert packed_layer_bytes(2048, 2, 32, torch.float32, SERVING_QUANT) <= fp32 * (1 / 16 + 1 / 32 + 1 / 16) + 8 * 16


def test_bits_that_do_not_pack_into_bytes_are_refused():
    k, v = _kv(64)
    with pytest.raises(ValueError, match="1, 2, 4 or 8 bits"):
        pack_layer(k, v, KVQuantConfig(bits=3, group=32, residual=0))


def test_a_flagged_layer_lands_dequantized_and_local_and_others_stay_remote():
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype=torch.float32, num_blocks=8)
    pool = DecodePool(layout, num_slots=2, max_tokens=400)
    slot = pool.allocate(300)
    k, v = _kv(300)
    packed = pack_layer(k, v, SERVING_QUANT)
    region = pool.byte_views()["quant"]
    start = pool.geometry.quant_offset(1, slot)
    region[start : start + packed.numel()] = packed
    assert pool.land_quantized(slot, 300) == 0  # no flag yet: nothing lands
    pool.byte_views()["quant_ready"][pool.geometry.ready_offset(1, slot)] = 1
    assert pool.land_quantized(slot, 300) == 1
    k_ref, v_ref = reference(k, v, SERVING_QUANT)
    assert torch.equal(pool.k[1, slot, :300], k_ref) and torch.equal(pool.v[1, slot, :300], v_ref)
    assert pool.masks.all_local(slot, 300) is False
    assert bool((pool.masks.values[1, slot, :300] == 1).all())
    assert pool.land_quantized(slot, 300) == 0  # the flag was cleared


def test_ready_layers_are_read_safely_while_a_lane_sets_flags():
    """A lane's receive thread sets quant_ready flags while the decode thread looks for landed layers: nonzero()
    straight over the changing flags failed an internal assert in CI (and corrupted the heap in a stress run)."""
    import sys
    import threading

    layout = KVLayout(num_layers=32, num_kv_heads=2, head_dim=16, dtype=torch.float32, num_blocks=8)
    pool = DecodePool(layout, num_slots=2, max_tokens=64)
    slot = pool.allocate(32)
    flags = pool.quant_ready
    stop = threading.Event()

    def lane() -> None:
        i = 0
        while not stop.is_set():
            flags[i % 32, slot] ^= 1
            i += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)  # switch often, as the decode node does
    writer = threading.Thread(target=lane)
    writer.start()
    try:
        for _ in range(20000):
            layers = pool.ready_layers(slot)
            assert layers == sorted(set(layers)) and all(0 <= layer < 32 for layer in layers)
    finally:
        stop.set()
        writer.join()
        sys.setswitchinterval(interval)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_staging_slot_holds_a_packed_layer_of_every_length_up_to_the_slot(dtype):
    # packed size is not monotonic in the length (up to G - 1 keys past a whole group stay exact): a 505-token
    # prompt packs larger than a 582-token one, which once overflowed a slot sized for its full length
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=dtype, num_blocks=8)
    for max_tokens in (1, 100, 128, 160, 582, 1000):
        room = DecodePool(layout, num_slots=1, max_tokens=max_tokens).geometry.quant_layer_bytes
        sizes = [packed_layer_bytes(n, 2, 32, dtype, SERVING_QUANT) for n in range(1, max_tokens + 1)]
        assert room == max(sizes)
    assert packed_layer_bytes(505, 2, 32, torch.float32, SERVING_QUANT) > packed_layer_bytes(
        582, 2, 32, torch.float32, SERVING_QUANT
    )


def test_slot_extents_cover_the_packed_layer_and_its_flag_only():
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, num_blocks=8)
    pool = DecodePool(layout, num_slots=3, max_tokens=500)
    extents = pool.geometry.slot_extents(1, 300)
    packed = packed_layer_bytes(300, 2, 16, torch.float32, SERVING_QUANT)
    assert extents["quant"] == [
        (pool.geometry.quant_offset(layer, 1), pool.geometry.quant_offset(layer, 1) + packed) for layer in range(2)
    ]
    assert extents["quant_ready"] == [(layer * 3 + 1, layer * 3 + 2) for layer in range(2)]


def test_quant2_moves_packed_bytes_and_decodes_on_what_they_carry():
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, num_blocks=16)
    cfg = SimulationConfig(layout=layout, lengths=(600, 90), steps=4, select_ratio=0.2, gbps=0.5)
    quant = simulate(cfg, POLICIES["quant2"])
    full = simulate(cfg, POLICIES["full"])
    # the assembled KV equals the dequantized prompt (simulate's truth for a quantized policy), bit for bit
    assert quant.mismatches == 0 and quant.all_local and quant.pool_equals_prefill
    packed = sum(4 * packed_layer_bytes(n, 2, 16, torch.float32, SERVING_QUANT) for n in cfg.lengths)
    assert quant.path_bytes == {"proactive": packed, "speculative": 0, "on_demand": 0}
    assert full.path_bytes["proactive"] == sum(layout.kv_bytes(n) for n in cfg.lengths) > packed
    assert quant.prefill_requests_left == 0 and all(r["error"] is None for r in quant.requests)
    # lossy: what landed is not the prompt
    k, _ = synthetic_kv(layout, 600, seed=0)
    assert not torch.equal(reference(k[2], k[2], SERVING_QUANT)[0], k[2])


def test_only_full_transfer_can_be_quantized():
    with pytest.raises(ValueError, match="only full transfer"):
        get_policy("smartgen").__class__("x", quantize_bits=2)


def test_quant2_served_over_tcp_gives_the_tokens_of_quantized_kv(model_dir, tmp_path):
    """Real nodes: the decode node attends to what crossed the link packed, which must be exactly the reference
    quantization of the prefill KV (the evaluation's quant2: full transfer of quantize_kv'd layers)."""
    import httpx
    from conftest import Nodes, get_json, wait_until
    from transformers import AutoTokenizer

    from smartgen.apps.quantization import KVQuantizer
    from smartgen.runtime.models import load_model
    from smartgen.runtime.pipeline import InprocPipeline

    ids = torch.randint(3, 90, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    pair = Nodes(model_dir, tmp_path)
    try:
        pair.wait_ready()
        body = {"prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "scheme": "quant2"}
        served = httpx.post(pair.url + "/v1/completions", json=body, timeout=120).json()
        assert served["usage"]["completion_tokens"] == 6, served
        wait_until(lambda: get_json(pair.status_url)["requests_held"] == 0, 30, "the prefill node to free it")
        moved = get_json(pair.status_url)["paths"]["bytes"]["full"]
    finally:
        pair.stop()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    quantizer = KVQuantizer(SERVING_QUANT)
    selector = ("quest", {"budget": 0.1})  # the nodes' (`serve` defaults): a quantized transfer still decodes sparsely
    with InprocPipeline(
        load_model(model_dir), get_policy("full"), *selector, num_blocks=16, kv_transform=quantizer
    ) as p:
        [local] = p.generate([ids], 6)
    assert served["choices"][0]["text"] == tokenizer.decode(local.tokens, skip_special_tokens=True)
    layout = p.layout
    assert moved == layout.num_layers * packed_layer_bytes(
        300, layout.num_kv_heads, layout.head_dim, layout.dtype, SERVING_QUANT
    )
