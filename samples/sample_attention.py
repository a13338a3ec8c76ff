"""Eager attention for the sample model that can restrict layers >= L to a token subset, and probe rows.

Registered with transformers' AttentionInterface as "sample_restrict". Rows before `Restriction.start`
(the densely prefilled prompt) attend causally over everything, through SDPA; rows from `start` on (the
tail of the prompt and every generated token: the decode steps, as in Quest's passkey protocol) in
layers from_layer <= l < until_layer see only:
  - "streaming": the first `sinks` tokens and the most recent `recent` share of the context (StreamingLLM);
  - "topk": the `topk` share of the context with the highest attention scores, per head and row (oracle).
A row at position p has a context of p + 1 tokens; budgets are ceil(share · (p + 1)).
With `probe` set, the attention weights of the last row of the first forward (the answer position of a
prompt) are kept per layer: [H, n].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

NAME = "sample_restrict"
MODES = ("full", "streaming", "topk")


@dataclass
class Restriction:
    mode: str = "full"
    from_layer: int = 2
    until_layer: int = 1_000  # layers from_layer <= l < until_layer are restricted
    start: int = 0  # first restricted query position
    sinks: int = 4
    recent: float = 0.10
    topk: float = 0.20
    probe: bool = False
    probed: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [H, n] weights of the last prompt row

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")


STATE = Restriction()


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _allowed(scores: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
    """Boolean [B, H, r, n] of the keys each row may read. scores [B, H, r, n], positions [r]."""
    n = scores.shape[-1]
    keys = torch.arange(n)
    causal = keys[None, :] <= positions[:, None]  # [r, n]
    if STATE.mode == "full" or not STATE.from_layer <= layer < STATE.until_layer:
        return causal.expand_as(scores)
    context = (positions + 1).float()
    if STATE.mode == "streaming":
        recent = torch.ceil(STATE.recent * context).long()
        window = keys[None, :] > (positions - recent)[:, None]
        return (causal & (window | (keys[None, :] < STATE.sinks))).expand_as(scores)
    budget = torch.ceil(STATE.topk * context).long().clamp(min=1)  # [r]
    ranked = scores.masked_fill(~causal, float("-inf")).sort(dim=-1, descending=True).values
    threshold = ranked.gather(-1, (budget - 1).view(1, 1, -1, 1).expand(*scores.shape[:2], -1, 1))
    return causal & (scores >= threshold)


def sample_restrict_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [B, H, q, d], key/value [B, Hkv, n, d] (cache included); returns ([B, q, H, d], None)."""
    b, h, q_len, d = query.shape
    n = key.shape[2]
    scaling = scaling if scaling is not None else 1.0 / math.sqrt(d)
    key = _repeat_kv(key, h // key.shape[1])
    value = _repeat_kv(value, h // value.shape[1])
    first = n - q_len  # absolute position of query row 0 (batch of one, no padding)
    layer = module.layer_idx
    restricted = STATE.mode != "full" and STATE.from_layer <= layer < STATE.until_layer
    dense_rows = q_len if not restricted else max(0, min(q_len, STATE.start - first))
    outputs = []
    if dense_rows:
        k_end = first + dense_rows
        if first == 0:  # square causal prefill block
            out = F.scaled_dot_product_attention(
                query[:, :, :dense_rows], key[:, :, :k_end], value[:, :, :k_end], is_causal=True, scale=scaling
            )
        else:  # decode rows with a cache: every cached key is in the past
            mask = torch.arange(k_end)[None, :] <= (first + torch.arange(dense_rows))[:, None]
            out = F.scaled_dot_product_attention(
                query[:, :, :dense_rows], key[:, :, :k_end], value[:, :, :k_end], attn_mask=mask, scale=scaling
            )
        outputs.append(out)
    for lo in range(dense_rows, q_len, 512):  # restricted rows, in chunks to bound the [H, r, n] scores
        hi = min(q_len, lo + 512)
        positions = first + torch.arange(lo, hi)
        scores = torch.matmul(query[:, :, lo:hi].float(), key.float().transpose(2, 3)) * scaling
        allowed = _allowed(scores, positions, layer)
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        outputs.append(torch.matmul(weights.to(value.dtype), value))
    out = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
    if STATE.probe and first == 0 and layer not in STATE.probed:
        last = torch.matmul(query[:, :, -1:].float(), key.float().transpose(2, 3)) * scaling  # [B, H, 1, n]
        if restricted:
            last = last.masked_fill(~_allowed(last, torch.tensor([n - 1]), layer), float("-inf"))
        STATE.probed[layer] = torch.softmax(last, dim=-1)[0, :, 0]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, sample_restrict_attention)
