"""KIVI/HACK-like low-bit KV quantization: the reference (quantize, then dequantize) and the wire format.

Layout, as KIVI does it (REFERENCE.md section 5), for K and V of shape [n, H, d] (token-major, as the
prefill hand-off gives them):
- keys per channel: each (head, channel) gets groups of G consecutive tokens;
- values per token: each (token, head) gets groups of G channels (G is cut to d when d < G, as HACK
  does; where G does not divide d, the largest divisor of d below G, at least MIN_VALUE_GROUP: head size 80
  groups its values by 20, 48 by 24, 112 by 28);
- asymmetric min/max per group, stored as fp16 (KIVI's storage): zero = min, scale = (max - min) / (2^bits - 1),
  code = clamp(round((x - zero) / scale), 0, 2^bits - 1), x_hat = code · scale + zero;
- a residual window: the last R tokens stay exact (keys: also the < G tokens left over so that key
  groups are whole). KIVI's steady state during decode: the newest <= R tokens are unquantized.

`quantize_kv` is the reference: it returns dequantized tensors. `pack_layer` turns one layer into the
bytes a quantized transfer moves (packed codes, fp16 scale and zero per group, the residual in the KV's
own dtype) and `unpack_layer` turns them back; unpack(pack(k, v)) equals quantize_kv(k, v) exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "KVQuantConfig",
    "fake_quantize",
    "quantize_kv",
    "pack_layer",
    "unpack_layer",
    "packed_layer_bytes",
    "SERVING_QUANT",
    "MIN_VALUE_GROUP",
    "QuantUnsupported",
    "quant_unsupported",
]

FP16_BYTES = 2
ALIGN = 16  # every section of a packed layer starts at a multiple of this, so it can be viewed as its dtype
# below 8 channels a group's fp16 scale and zero cost more than its 2-bit codes save (4 bits a value at 8, 32 at 1)
MIN_VALUE_GROUP = 8


class QuantUnsupported(ValueError):
    """The quantized scheme cannot group this head size's values; the message says why (other schemes can)."""


@dataclass(frozen=True, slots=True)
class KVQuantConfig:
    """bits per code, group size G and residual window R (KIVI's LongBench setting: 2 bits, G=32, R=128)."""

    bits: int = 2
    group: int = 32
    residual: int = 128

    def __post_init__(self) -> None:
        if not 1 <= self.bits <= 8:
            raise ValueError(f"quantization bits must be in [1, 8], got {self.bits}")
        if self.group < 1:
            raise ValueError(f"quantization group size must be >= 1, got {self.group}")
        if self.residual < 0:
            raise ValueError(f"residual window must be >= 0 tokens, got {self.residual}")

    def value_group(self, head_dim: int) -> int:
        """Channels per value group: G, cut to d; where G does not divide d, the largest divisor of d below G
        (QuantUnsupported when that is under MIN_VALUE_GROUP: head size 74 has only 2 and 37)."""
        group = min(self.group, head_dim)
        while head_dim % group:
            group -= 1
        if group < min(MIN_VALUE_GROUP, head_dim, self.group):
            raise QuantUnsupported(
                f"{self.bits}-bit KV cannot group head size {head_dim}: it has no divisor between "
                f"{min(MIN_VALUE_GROUP, self.group)} and {min(self.group, head_dim)} to group its values by"
            )
        return group

    def split(self, num_tokens: int) -> tuple[int, int]:
        """(quantized keys, quantized values): tokens [0, count) are quantized, the rest kept exact."""
        values = max(0, num_tokens - self.residual)
        return values // self.group * self.group, values


# the scheme `quant2` serves with: KIVI's LongBench setting
SERVING_QUANT = KVQuantConfig(bits=2, group=32, residual=128)


def quant_unsupported(head_dim: int, config: KVQuantConfig = SERVING_QUANT) -> str | None:
    """Why `config` cannot quantize KV of this head size, or None when it can (the one check `quant2` makes)."""
    try:
        config.value_group(head_dim)
    except QuantUnsupported as exc:
        return str(exc)
    return None


def _params(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., G] -> (codes [..., G] uint8, scale [..., 1] fp16, zero [..., 1] fp16)."""
    x = x.float()
    zero = x.amin(dim=-1, keepdim=True).half()
    levels = 2**bits - 1
    scale = ((x.amax(dim=-1, keepdim=True) - zero.float()) / levels).half()
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    codes = ((x - zero.float()) / safe).round_().clamp_(0, levels).to(torch.uint8)
    return codes, scale, zero


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.float() + zero.float()


def fake_quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantize -> dequantize over the last dim (one group per row), fp16 scale and zero.

    x [..., G] -> (x_hat [..., G] float32, scale [..., 1] float32). A constant group has scale 0 and
    comes back as its value rounded to fp16.
    """
    codes, scale, zero = _params(x, bits)
    return _dequantize(codes, scale, zero), scale.float()


def _key_groups(k: torch.Tensor, num_keys: int, group: int) -> torch.Tensor:
    """[n, H, d] -> the quantized keys as groups of G tokens on the last dim: [n_q/G, H, d, G]."""
    _, heads, dim = k.shape
    return k[:num_keys].reshape(num_keys // group, group, heads, dim).permute(0, 2, 3, 1)


def _value_groups(v: torch.Tensor, num_values: int, group: int) -> torch.Tensor:
    """[n, H, d] -> the quantized values as groups of G channels: [n_q, H, d/G, G]."""
    _, heads, dim = v.shape
    return v[:num_values].reshape(num_values, heads, dim // group, group)


def _check(k: torch.Tensor, v: torch.Tensor) -> None:
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [n, H, d], got {tuple(k.shape)} and {tuple(v.shape)}")


def quantize_kv(k: torch.Tensor, v: torch.Tensor, config: KVQuantConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [n, H, d] -> their dequantized low-bit versions, same shape and dtype; residual exact."""
    _check(k, v)
    n, heads, dim = k.shape
    num_keys, num_values = config.split(n)
    k_out, v_out = k.clone(), v.clone()
    if num_keys:
        k_hat, _ = fake_quantize(_key_groups(k, num_keys, config.group), config.bits)
        k_out[:num_keys] = k_hat.permute(0, 3, 1, 2).reshape(num_keys, heads, dim).to(k.dtype)
    if num_values:
        v_hat, _ = fake_quantize(_value_groups(v, num_values, config.value_group(dim)), config.bits)
        v_out[:num_values] = v_hat.reshape(num_values, heads, dim).to(v.dtype)
    return k_out, v_out


# -- the wire format -----------------------------------------------------------------------------------------


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN) * ALIGN


def _sections(
    num_tokens: int, heads: int, dim: int, dtype: torch.dtype, config: KVQuantConfig
) -> list[tuple[str, int]]:
    """(name, bytes) of a packed layer's sections, in order, each padded to ALIGN."""
    num_keys, num_values = config.split(num_tokens)
    row = heads * dim
    key_groups = num_keys // config.group * row
    value_groups = num_values * heads * (dim // config.value_group(dim)) if num_values else 0
    element = torch.empty((), dtype=dtype).element_size()
    sizes = [
        ("k_codes", -(-num_keys * row * config.bits // 8)),
        ("k_scale", key_groups * FP16_BYTES),
        ("k_zero", key_groups * FP16_BYTES),
        ("v_codes", -(-num_values * row * config.bits // 8)),
        ("v_scale", value_groups * FP16_BYTES),
        ("v_zero", value_groups * FP16_BYTES),
        ("k_rest", (num_tokens - num_keys) * row * element),
        ("v_rest", (num_tokens - num_values) * row * element),
    ]
    return [(name, _aligned(size)) for name, size in sizes]


def packed_layer_bytes(num_tokens: int, heads: int, dim: int, dtype: torch.dtype, config: KVQuantConfig) -> int:
    """Bytes one layer of `num_tokens` tokens takes packed (what a quantized transfer moves for it)."""
    return sum(size for _, size in _sections(num_tokens, heads, dim, dtype, config))


def _pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (< 2^bits) -> bytes, 8 // bits codes per byte, low bits first (bits in 1, 2, 4, 8)."""
    per_byte = 8 // bits
    flat = codes.flatten()
    flat = torch.nn.functional.pad(flat, (0, -flat.numel() % per_byte)).view(-1, per_byte).to(torch.int32)
    shifts = torch.arange(per_byte, dtype=torch.int32) * bits
    return (flat << shifts).sum(dim=1).to(torch.uint8)


def _unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, dtype=torch.int32, device=packed.device) * bits
    codes = (packed.to(torch.int32).unsqueeze(1) >> shifts) & (2**bits - 1)
    return codes.flatten()[:count].to(torch.uint8)


def _packable(config: KVQuantConfig) -> None:
    if 8 % config.bits:
        raise ValueError(f"the wire format packs 1, 2, 4 or 8 bits per code, not {config.bits}")


def pack_layer(k: torch.Tensor, v: torch.Tensor, config: KVQuantConfig) -> torch.Tensor:
    """One layer's K/V [n, H, d] -> its packed bytes (uint8, `packed_layer_bytes` long), on the CPU."""
    _check(k, v)
    _packable(config)
    n, heads, dim = k.shape
    num_keys, num_values = config.split(n)
    k, v = k.cpu(), v.cpu()
    parts: dict[str, torch.Tensor] = {}
    if num_keys:
        codes, scale, zero = _params(_key_groups(k, num_keys, config.group), config.bits)
        parts.update(k_codes=_pack_codes(codes, config.bits), k_scale=scale, k_zero=zero)
    if num_values:
        codes, scale, zero = _params(_value_groups(v, num_values, config.value_group(dim)), config.bits)
        parts.update(v_codes=_pack_codes(codes, config.bits), v_scale=scale, v_zero=zero)
    parts.update(k_rest=k[num_keys:], v_rest=v[num_values:])
    out = torch.zeros(packed_layer_bytes(n, heads, dim, k.dtype, config), dtype=torch.uint8)
    offset = 0
    for name, size in _sections(n, heads, dim, k.dtype, config):
        if name in parts and parts[name].numel():
            raw = parts[name].contiguous().view(-1).view(torch.uint8)
            out[offset : offset + raw.numel()] = raw
        offset += size
    return out


def unpack_layer(
    packed: torch.Tensor, num_tokens: int, heads: int, dim: int, dtype: torch.dtype, config: KVQuantConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed bytes (on any device) -> the layer's dequantized K, V [n, H, d] of `dtype`, on that device."""
    _packable(config)
    n = num_tokens
    num_keys, num_values = config.split(n)
    view: dict[str, torch.Tensor] = {}
    offset = 0
    for name, size in _sections(n, heads, dim, dtype, config):
        view[name] = packed[offset : offset + size]
        offset += size
    if offset > packed.numel():
        raise ValueError(f"a packed {n}-token layer takes {offset} bytes, got {packed.numel()}")

    def tensor(name: str, kind: torch.dtype, count: int) -> torch.Tensor:
        element = torch.empty((), dtype=kind).element_size()
        return view[name][: count * element].view(kind)

    row = heads * dim
    k = torch.empty(n, heads, dim, dtype=dtype, device=packed.device)
    v = torch.empty_like(k)
    if num_keys:
        groups = num_keys // config.group * row
        codes = _unpack_codes(view["k_codes"], config.bits, num_keys * row).view(-1, heads, dim, config.group)
        scale = tensor("k_scale", torch.float16, groups).view(-1, heads, dim, 1)
        zero = tensor("k_zero", torch.float16, groups).view(-1, heads, dim, 1)
        k[:num_keys] = _dequantize(codes, scale, zero).permute(0, 3, 1, 2).reshape(num_keys, heads, dim).to(dtype)
    if num_values:
        group = config.value_group(dim)
        count = num_values * heads * (dim // group)
        codes = _unpack_codes(view["v_codes"], config.bits, num_values * row).view(num_values, heads, -1, group)
        scale = tensor("v_scale", torch.float16, count).view(num_values, heads, -1, 1)
        zero = tensor("v_zero", torch.float16, count).view(num_values, heads, -1, 1)
        v[:num_values] = _dequantize(codes, scale, zero).reshape(num_values, heads, dim).to(dtype)
    k[num_keys:] = tensor("k_rest", dtype, (n - num_keys) * row).view(-1, heads, dim)
    v[num_values:] = tensor("v_rest", dtype, (n - num_values) * row).view(-1, heads, dim)
    return k, v
