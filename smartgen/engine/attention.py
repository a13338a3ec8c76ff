"""Decode attention over the selected KV of each (batch, KV head) row: the PyTorch reference and CPU path."""

from __future__ import annotations

import torch

__all__ = ["sparse_decode_attention", "span_decode_attention"]


def sparse_decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    num_valid: torch.Tensor,
    scale: float | None = None,
    extra_key: torch.Tensor | None = None,
    extra_value: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One decode step's attention over gathered entries.

    query [B, Hq, d]; keys / values [B·H, k, d] with rows laid out as `assemble` returns
    them (entries [0, num_valid[r]) real, the rest padding); num_valid [B·H]. The Hq / H
    query heads of a GQA group share their KV head's row. Order inside a row does not
    matter: positions are already in the (post-RoPE) keys. extra_key / extra_value [B·H, d]:
    one more entry per row that is always attended (the token being decoded). softcap:
    Gemma-style tanh capping of the logits. Returns [B, Hq, d] in the query's dtype.
    """
    batch, num_q_heads, head_dim = query.shape
    rows, k, _ = keys.shape
    num_kv_heads = rows // batch
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    q = query.reshape(batch * num_kv_heads, group, head_dim).float()  # [R, G, d]
    scores = torch.bmm(q, keys.float().transpose(1, 2)) * scale  # [R, G, k]
    padding = torch.arange(k, device=keys.device).unsqueeze(0) >= num_valid.unsqueeze(1).long()  # [R, k]
    vals = values.float()
    if extra_key is not None:
        if extra_value is None:
            raise ValueError("extra_key needs extra_value: the extra entry is attended with its value")
        extra = torch.bmm(q, extra_key.float().unsqueeze(2)) * scale  # [R, G, 1]
        scores = torch.cat([scores, extra], dim=2)
        padding = torch.cat([padding, torch.zeros_like(padding[:, :1])], dim=1)
        vals = torch.cat([vals, extra_value.float().unsqueeze(1)], dim=1)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores.masked_fill_(padding.unsqueeze(1), float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # a row with no entries attends to nothing
    out = torch.bmm(weights, vals)  # [R, G, d]
    return out.view(batch, num_q_heads, head_dim).to(query.dtype)


def span_decode_attention(
    query: torch.Tensor,
    spans: list[tuple[torch.Tensor, torch.Tensor]],
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Decode attention of each request over one contiguous span of its pool (dense and window layers).

    query [B, Hq, d]; spans[b] = (K, V) views [n_b, H, d] straight from the token-major
    pool, never copied into rows. Returns [B, Hq, d] in the query's dtype.
    """
    batch, num_q_heads, head_dim = query.shape
    scale = head_dim**-0.5 if scale is None else scale
    outputs = []
    for b, (keys, values) in enumerate(spans):
        num_kv_heads = keys.shape[1]
        group = num_q_heads // num_kv_heads
        q = query[b].reshape(num_kv_heads, group, head_dim).float()  # [H, G, d]
        k = keys.permute(1, 2, 0).float()  # [H, d, n] (a view for fp32)
        scores = torch.bmm(q, k) * scale  # [H, G, n]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        weights = torch.softmax(scores, dim=-1)
        outputs.append(torch.bmm(weights, values.transpose(0, 1).float()).reshape(num_q_heads, head_dim))  # [Hq, d]
    return torch.stack(outputs).to(query.dtype)
