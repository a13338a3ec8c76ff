"""KIVI-like KV quantization: error within half a step, residual exact, layout per channel / per token, byte counts."""

import pytest
import torch

from smartgen.apps.quantization import KVQuantConfig, KVQuantizer, fp16_kv_bytes, quantize_kv
from smartgen.engine.kv_quant import packed_layer_bytes


def _kv(n=100, heads=2, dim=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, heads, dim, generator=g) * torch.linspace(0.1, 4, dim)  # channels of very different ranges
    v = torch.randn(n, heads, dim, generator=g)
    return k.to(dtype), v.to(dtype)


def _key_steps(k, cfg, num_keys):
    """Per element of the quantized keys: its group's step (max - min) / (2^b - 1), by explicit loops."""
    steps = torch.zeros(num_keys, *k.shape[1:])
    for start in range(0, num_keys, cfg.group):
        block = k[start : start + cfg.group].float()  # [G, H, d]: one group per (head, channel)
        steps[start : start + cfg.group] = (block.amax(0) - block.amin(0)) / (2**cfg.bits - 1)
    return steps


def _value_steps(v, cfg, num_values):
    group = cfg.value_group(v.shape[-1])
    steps = torch.zeros(num_values, *v.shape[1:])
    for c in range(0, v.shape[-1], group):
        block = v[:num_values, :, c : c + group].float()  # [n, H, G]: one group per (token, head)
        steps[:, :, c : c + group] = ((block.amax(-1) - block.amin(-1)) / (2**cfg.bits - 1)).unsqueeze(-1)
    return steps


@pytest.mark.parametrize("n,group,residual", [(100, 8, 20), (37, 4, 0), (64, 32, 32), (130, 16, 5)])
def test_round_trip_error_is_at_most_half_a_step_and_the_residual_is_exact(n, group, residual):
    cfg = KVQuantConfig(bits=2, group=group, residual=residual)
    k, v = _kv(n)
    k_hat, v_hat = quantize_kv(k, v, cfg)
    num_keys, num_values = cfg.split(n)
    assert num_keys % group == 0 and n - num_keys >= residual and num_values == max(0, n - residual)
    # scale and zero are stored as fp16 (KIVI's storage): each adds up to half an fp16 ulp of the group's range
    tol = 1e-5 + 2**-10 * max(float(k.abs().max()), float(v.abs().max()))
    assert ((k_hat[:num_keys] - k[:num_keys]).abs() <= _key_steps(k, cfg, num_keys) / 2 + tol).all()
    assert ((v_hat[:num_values] - v[:num_values]).abs() <= _value_steps(v, cfg, num_values) / 2 + tol).all()
    assert torch.equal(k_hat[num_keys:], k[num_keys:]) and torch.equal(v_hat[num_values:], v[num_values:])
    assert not torch.equal(k_hat, k) and not torch.equal(v_hat, v)


def test_keys_are_grouped_per_channel_and_values_per_token():
    cfg = KVQuantConfig(bits=2, group=8, residual=0)
    k, v = _kv(64)
    k_hat, v_hat = quantize_kv(k, v, cfg)
    # at most 2^bits distinct values per key group (G tokens of one head and channel) ...
    for start in range(0, 64, 8):
        for h in range(2):
            for c in range(16):
                assert k_hat[start : start + 8, h, c].unique().numel() <= 4
    # ... and per value group (G channels of one token and head)
    for t in range(64):
        for h in range(2):
            for c in range(0, 16, 8):
                assert v_hat[t, h, c : c + 8].unique().numel() <= 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shapes_and_dtypes_are_kept_and_inputs_untouched(dtype):
    k, v = _kv(50, dtype=dtype)
    k0, v0 = k.clone(), v.clone()
    k_hat, v_hat = quantize_kv(k, v, KVQuantConfig(2, 8, 10))
    assert k_hat.shape == k.shape and v_hat.shape == v.shape and k_hat.dtype == v_hat.dtype == dtype
    assert torch.equal(k, k0) and torch.equal(v, v0)


def test_non_contiguous_inputs():
    k, v = _kv(48)
    kt = k.transpose(0, 1).contiguous().transpose(0, 1)  # same values, another memory layout
    a = quantize_kv(k, v, KVQuantConfig(2, 8, 8))
    b = quantize_kv(kt, v, KVQuantConfig(2, 8, 8))
    assert torch.equal(a[0], b[0])


def test_eight_bits_is_near_lossless():
    k, v = _kv(256)
    k_hat, v_hat = quantize_kv(k, v, KVQuantConfig(bits=8, group=32, residual=0))
    assert (k_hat - k).abs().max() <= (k.amax() - k.amin()) / 255 / 2 + 1e-5
    assert torch.allclose(v_hat, v, atol=0.02)


def test_short_prompts_stay_in_full_precision():
    k, v = _kv(100)
    k_hat, v_hat = quantize_kv(k, v, KVQuantConfig(residual=128))
    assert torch.equal(k_hat, k) and torch.equal(v_hat, v)


def test_a_constant_group_comes_back_exact():
    k = torch.full((32, 1, 8), 0.75)
    k_hat, v_hat = quantize_kv(k, k.clone(), KVQuantConfig(2, 8, 0))
    assert torch.equal(k_hat, k) and torch.equal(v_hat, k)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="bits"):
        KVQuantConfig(bits=0)
    with pytest.raises(ValueError, match="group"):
        KVQuantConfig(group=0)
    with pytest.raises(ValueError, match="cannot group head size 12"):
        quantize_kv(*_kv(64, dim=12), KVQuantConfig(2, 8, 0))
    with pytest.raises(ValueError, match="k and v"):
        quantize_kv(torch.zeros(4, 2, 8), torch.zeros(4, 2, 4), KVQuantConfig())


def test_transfer_bytes():
    cfg = KVQuantConfig(bits=2, group=32, residual=128)
    # n = 1000: keys quantize 864 tokens (27 groups), values 872; H = 2, d = 32 (64 elements a token)
    codes = (864 + 872) * 64 * 2 / 8
    params = (27 * 64 + 872 * 2 * 1) * 2 * 2
    residual = (136 + 128) * 64 * 2
    # every section of the wire format is a multiple of 16 bytes here: the count is exact
    assert packed_layer_bytes(1000, 2, 32, torch.float16, cfg) == codes + params + residual
    assert fp16_kv_bytes(1000, 2, 32) == 1000 * 64 * 2 * 2
    # long prompts approach bits/16 plus the scale/zero overhead: 2/16 + 4 bytes per 32 elements / 2 bytes
    ratio = packed_layer_bytes(64 * 1024, 8, 128, torch.float16, cfg) / fp16_kv_bytes(64 * 1024, 8, 128)
    assert 0.1875 < ratio < 0.19


def test_quantizer_is_a_kv_transform_that_counts_bytes():
    quantizer = KVQuantizer(KVQuantConfig(2, 8, 8))
    assert quantizer.byte_ratio is None
    k, v = _kv(64)
    for layer in range(3):
        k_hat, _ = quantizer(layer, k, v)
    assert torch.equal(k_hat, quantize_kv(k, v, quantizer.config)[0])
    assert quantizer.fp16_bytes == 3 * fp16_kv_bytes(64, 2, 16)
    assert 0 < quantizer.byte_ratio < 0.5
