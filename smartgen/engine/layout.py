"""KV layout: model shape, relative KV blocks, and block <-> token-range mapping.

Blocks are positional and relative: a prompt of n tokens is cut into M_eff = min(M, n)
blocks per layer, block m covering tokens [floor(m·n/M_eff), floor((m+1)·n/M_eff)).
A prompt shorter than M tokens therefore gets one block per token (no empty blocks),
and a profile over M relative blocks is resampled to it (see `resample_importance`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "DEFAULT_NUM_BLOCKS",
    "KVLayout",
    "effective_blocks",
    "block_bounds",
    "token_blocks",
    "resample_importance",
    "DENSE_LAYERS",
]

# Layers 0 and 1 attend densely on the decode node: they are always sent whole during prefill, need no
# selector metadata, and are never fetched. One constant for the engine's plans and the runtime's attention.
DENSE_LAYERS = 2

DEFAULT_NUM_BLOCKS = 1024


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of a model's KV cache: L layers, H KV heads, head dim d, element type."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    num_blocks: int = DEFAULT_NUM_BLOCKS

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVLayout.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_layers < 2:
            raise ValueError("SmartGen needs at least 2 layers (layers 0 and 1 are always sent whole)")

    @property
    def itemsize(self) -> int:
        # the dtype's own size: making an empty tensor to ask cost ~5 us a call, and `token_bytes` (every descriptor's
        # offset) asks it tens of thousands of times a request (0.5 s of a prefill node's speculation thread a burst)
        return self.dtype.itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer: H·d elements."""
        return self.num_kv_heads * self.head_dim * self.itemsize

    def kv_bytes(self, num_tokens: int, num_layers: int | None = None) -> int:
        """Bytes of K and V of num_tokens tokens over num_layers layers (default all)."""
        layers = self.num_layers if num_layers is None else num_layers
        return 2 * layers * num_tokens * self.token_bytes

    def blocks_for(self, length: int) -> int:
        return effective_blocks(length, self.num_blocks)


def effective_blocks(length: int, num_blocks: int) -> int:
    """M_eff = min(M, n): a prompt shorter than M tokens gets one block per token."""
    if length < 1:
        raise ValueError(f"a request needs at least one token, got length {length}")
    return min(num_blocks, length)


def block_bounds(length: int, num_blocks: int) -> torch.Tensor:
    """Token boundaries of the M_eff blocks of a prompt: int64 [M_eff + 1], from 0 to length."""
    m_eff = effective_blocks(length, num_blocks)
    return torch.arange(m_eff + 1, dtype=torch.int64) * length // m_eff


def token_blocks(length: int, num_blocks: int) -> torch.Tensor:
    """The block of each token: int64 [length] with values in [0, M_eff)."""
    bounds = block_bounds(length, num_blocks)
    return torch.searchsorted(bounds, torch.arange(length, dtype=torch.int64), right=True) - 1


def resample_importance(importance: torch.Tensor, length: int) -> torch.Tensor:
    """Maps a profile's [L, M] importance onto a request's [L, M_eff] blocks.

    With n >= M the blocks are the same relative ranges and nothing changes. With n < M,
    several relative blocks fall on one token; the token's block takes their mean.
    """
    num_layers, num_blocks = importance.shape
    m_eff = effective_blocks(length, num_blocks)
    if m_eff == num_blocks:
        return importance.clone()
    target = torch.arange(num_blocks, dtype=torch.int64) * m_eff // num_blocks  # [M] -> request block
    sums = torch.zeros(num_layers, m_eff, dtype=torch.float64).index_add_(1, target, importance.double())
    counts = torch.bincount(target, minlength=m_eff).double()
    return (sums / counts).to(importance.dtype)
