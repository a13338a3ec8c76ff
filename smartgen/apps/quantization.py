"""KIVI/HACK-like asymmetric low-bit KV quantization of one layer's prefill K/V (quantize, then dequantize).

Layout, as KIVI does it (REFERENCE.md section 5), for K and V of shape [n, H, d] (token-major, as the
prefill hand-off gives them):
- keys per channel: each (head, channel) gets groups of G consecutive tokens;
- values per token: each (token, head) gets groups of G channels (G is cut to d when d < G, as HACK
  does; it must divide d);
- asymmetric min/max per group: scale = (max - min) / (2^bits - 1), zero = min,
  code = clamp(round((x - zero) / scale), 0, 2^bits - 1), x_hat = code · scale + zero;
- a residual window: the last R tokens stay in full precision (keys: also the < G tokens left over
  so that key groups are whole). KIVI's steady state during decode: the newest <= R tokens are fp16.

This is the torch reference (and CPU path): it returns dequantized tensors, so the decode node's
attention runs unchanged on what a quantized transfer would deliver. `quantized_kv_bytes` counts what
such a transfer moves: packed codes, an fp16 scale and zero per group (KIVI's storage), fp16 residual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KVQuantConfig", "fake_quantize", "quantize_kv", "quantized_kv_bytes", "fp16_kv_bytes", "KVQuantizer"]

FP16_BYTES = 2


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
        """Channels per value group: G, cut to d; it must divide d."""
        group = min(self.group, head_dim)
        if head_dim % group:
            raise ValueError(f"value group size {group} must divide the head dim {head_dim}")
        return group

    def split(self, num_tokens: int) -> tuple[int, int]:
        """(quantized keys, quantized values): tokens [0, count) are quantized, the rest kept exact."""
        values = max(0, num_tokens - self.residual)
        return values // self.group * self.group, values


def fake_quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantize -> dequantize over the last dim (one group per row).

    x [..., G] -> (x_hat [..., G] float32, scale [..., 1] float32). A constant group has scale 0 and
    comes back exact.
    """
    x = x.float()
    low = x.amin(dim=-1, keepdim=True)
    high = x.amax(dim=-1, keepdim=True)
    levels = 2**bits - 1
    scale = (high - low) / levels
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((x - low) / safe).round_().clamp_(0, levels)
    return codes * scale + low, scale


def quantize_kv(k: torch.Tensor, v: torch.Tensor, config: KVQuantConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [n, H, d] -> their dequantized 2-bit (config.bits) versions, same shape and dtype; residual exact."""
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [n, H, d], got {tuple(k.shape)} and {tuple(v.shape)}")
    n, heads, dim = k.shape
    num_keys, num_values = config.split(n)
    k_out, v_out = k.clone(), v.clone()
    if num_keys:
        # [n_q, H, d] -> [n_q/G, G, H, d] -> groups of G tokens on the last dim: [n_q/G, H, d, G]
        groups = k[:num_keys].reshape(num_keys // config.group, config.group, heads, dim).permute(0, 2, 3, 1)
        k_hat, _ = fake_quantize(groups, config.bits)
        k_out[:num_keys] = k_hat.permute(0, 3, 1, 2).reshape(num_keys, heads, dim).to(k.dtype)
    if num_values:
        group = config.value_group(dim)
        groups = v[:num_values].reshape(num_values, heads, dim // group, group)  # [n_q, H, d/G, G]
        v_hat, _ = fake_quantize(groups, config.bits)
        v_out[:num_values] = v_hat.reshape(num_values, heads, dim).to(v.dtype)
    return k_out, v_out


def quantized_kv_bytes(num_tokens: int, num_kv_heads: int, head_dim: int, config: KVQuantConfig) -> int:
    """Bytes one layer's K+V take when sent quantized: packed codes + fp16 scale/zero per group + fp16 residual."""
    num_keys, num_values = config.split(num_tokens)
    row = num_kv_heads * head_dim  # elements per token
    codes = (num_keys + num_values) * row * config.bits / 8
    key_groups = num_keys // config.group * row
    value_groups = num_values * num_kv_heads * (head_dim // config.value_group(head_dim))
    params = (key_groups + value_groups) * 2 * FP16_BYTES
    residual = ((num_tokens - num_keys) + (num_tokens - num_values)) * row * FP16_BYTES
    return int(codes + params + residual)


def fp16_kv_bytes(num_tokens: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes one layer's K+V take in fp16."""
    return 2 * num_tokens * num_kv_heads * head_dim * FP16_BYTES


class KVQuantizer:
    """The pipeline's `kv_transform` for the quantized scheme: (layer, k, v) -> quantized k, v; counts bytes."""

    def __init__(self, config: KVQuantConfig) -> None:
        self.config = config
        self.quantized_bytes = 0
        self.fp16_bytes = 0

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, heads, dim = k.shape
        self.quantized_bytes += quantized_kv_bytes(n, heads, dim, self.config)
        self.fp16_bytes += fp16_kv_bytes(n, heads, dim)
        return quantize_kv(k, v, self.config)

    @property
    def byte_ratio(self) -> float | None:
        """Quantized bytes / fp16 bytes over every layer handed off so far (None before the first)."""
        return self.quantized_bytes / self.fp16_bytes if self.fp16_bytes else None
