"""Decode attention over the selected KV of each (batch, KV head) row: the PyTorch reference and CPU path."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["sparse_decode_attention", "span_decode_attention", "partial_attention", "merge_partials"]


def sparse_decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    num_valid: torch.Tensor,
    scale: float | None = None,
    extra_key: torch.Tensor | None = None,
    extra_value: torch.Tensor | None = None,
    softcap: float | None = None,
    with_stats: bool = False,
) -> Any:
    """One decode step's attention over gathered entries.

    query [B, Hq, d]; keys / values [B·H, k, d] with rows laid out as `assemble` returns
    them (entries [0, num_valid[r]) real, the rest padding); num_valid [B·H]. The Hq / H
    query heads of a GQA group share their KV head's row. Order inside a row does not
    matter: positions are already in the (post-RoPE) keys. extra_key / extra_value [B·H, d]:
    one more entry per row that is always attended (the token being decoded). softcap:
    Gemma-style tanh capping of the logits. Returns [B, Hq, d] in the query's dtype; with `with_stats`, (output
    [B, Hq, d] fp32, [B, Hq, 2] the softmax's max and sum), a part for `merge_partials`.
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
    if with_stats:  # the softmax's max and sum kept, the output left in fp32: a part to merge (`merge_partials`)
        out, stats = _normalised(scores, vals)
        return out.view(batch, num_q_heads, head_dim), stats.view(batch, num_q_heads, 2)
    weights = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # a row with no entries attends to nothing
    out = torch.bmm(weights, vals)  # [R, G, d]
    return out.view(batch, num_q_heads, head_dim).to(query.dtype)


def _normalised(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of scores [R, G, n] (-inf: not attended) over values [R, n, d]: (output [R, G, d] fp32,
    [R, G, 2] the scores' max and the sum of exp(score - max)); a row with no entries gives zeros, max -inf."""
    top = scores.amax(-1, keepdim=True)  # [R, G, 1]
    weights = (scores - top.clamp_min(torch.finfo(scores.dtype).min)).exp()  # -inf rows: exp(-inf) = 0
    total = weights.sum(-1, keepdim=True)
    out = torch.bmm(weights, values) / total.clamp_min(torch.finfo(scores.dtype).tiny)
    return out, torch.cat([top, total], -1)


def partial_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    heads: torch.Tensor,
    num_kv_heads: int,
    scale: float | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's attention over some of its entries, to be merged with the rest (`merge_partials`).

    query [Hq, d] (the `num_kv_heads` KV heads' groups in order); keys / values [E, d], entry e of KV head heads[e]
    (0 <= heads[e] < num_kv_heads). Returns
    (output [Hq, d] fp32, normalised over these entries only; [Hq, 2] fp32 the scores' max and the sum of
    exp(score - max)): a query head whose KV head has none of the entries gives zeros, max -inf and sum 0. Scores
    are scaled (default d^-0.5) and capped as `sparse_decode_attention` does, so the merge is exact."""
    num_q_heads, head_dim = query.shape
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not fall into {num_kv_heads} KV heads' groups")
    scale = head_dim**-0.5 if scale is None else scale
    scores = keys.float() @ query.float().T * scale  # [E, Hq]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    group = num_q_heads // num_kv_heads
    own = heads.unsqueeze(1) == torch.arange(num_q_heads, device=query.device).unsqueeze(0) // group  # [E, Hq]
    scores = scores.masked_fill(~own, float("-inf")).T.unsqueeze(0)  # [1, Hq, E]
    out, stats = _normalised(scores, values.float().unsqueeze(0))
    return out[0], stats[0]


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Attention over the union of disjoint parts' entries from each part's (output [..., d], [..., 2] max and sum)
    (`partial_attention`, `sparse_decode_attention(..., with_stats=True)`): the log-sum-exp merge of split
    attention, exact up to float rounding. Every query row must have an entry in some part."""
    top = torch.stack([stats[..., 0] for _, stats in parts]).amax(0)  # [...]
    weights = [stats[..., 1] * (stats[..., 0] - top).exp().nan_to_num(0.0) for _, stats in parts]
    total = torch.stack(weights).sum(0)
    return torch.stack([out * (w / total).unsqueeze(-1) for (out, _), w in zip(parts, weights)]).sum(0)


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
