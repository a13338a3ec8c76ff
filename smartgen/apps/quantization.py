"""KIVI/HACK-like low-bit KV quantization for evaluation: byte counts and the pipeline's `kv_transform`.

The quantization itself (KIVI's layout, fp16 scale and zero per group, the residual window) and its wire
format live in `smartgen.engine.kv_quant`; this module re-exports the reference. The evaluation reports beside
accuracy what a quantized transfer of fp16 KV moves: `packed_layer_bytes` of fp16 KV, the wire format's own size
(packed codes, an fp16 scale and zero per group, the fp16 residual: KIVI's storage), the one count of quantized
KV bytes there is.
"""

from __future__ import annotations

import torch

from smartgen.engine.kv_quant import KVQuantConfig, fake_quantize, packed_layer_bytes, quantize_kv

__all__ = ["KVQuantConfig", "fake_quantize", "quantize_kv", "fp16_kv_bytes", "KVQuantizer"]

FP16_BYTES = 2


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
        self.quantized_bytes += packed_layer_bytes(n, heads, dim, torch.float16, self.config)
        self.fp16_bytes += fp16_kv_bytes(n, heads, dim)
        return quantize_kv(k, v, self.config)

    @property
    def byte_ratio(self) -> float | None:
        """Quantized bytes / fp16 bytes over every layer handed off so far (None before the first)."""
        return self.quantized_bytes / self.fp16_bytes if self.fp16_bytes else None
