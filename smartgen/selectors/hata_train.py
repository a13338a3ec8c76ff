"""Trains HATA's hash weights on calibration prompts, so that the Hamming distance of codes ranks keys as q·k does.

Following gpzlx1/HATA (REFERENCE.md §3; `tasks/hash/learn_hash_weights.py`, `build_dataset.py`):

- Items: from each calibration prompt, `queries_per_prompt` query positions p drawn uniformly
  in [n/2, n) (HATA: one), each paired with the keys before it. Per query head, the top
  `positive_ratio` (10%) of those keys by q·k get weights linspace(20, 1) by rank, all others -1.
- Loss per layer, with relaxed codes c = 2·sigmoid(σ·xW) - 1 of queries and keys:
  ε·Σ weight·‖c_q - c_k‖² / m (pull the top keys' codes to the query's, push the rest away)
  + λ·‖mean(c_q + c_k)‖² per head (balanced bits) + η·‖WᵀW - I‖ (decorrelated bits).
- SGD (lr 0.1, momentum 0.9, weight decay 1e-6) from randn, full batch, `steps` steps per layer.

Choices of ours:
- HATA trains on every (query, earlier key) pair of its prompts; to keep a CPU run short, each
  query position keeps every head's top `keep_top` keys and a uniform sample of the others up to
  `keys_per_query`, the sampled ones weighted by the inverse of their sampling rate, so the loss
  is an unbiased estimate of the loss over all pairs.
- The decorrelation term: HATA's ‖WᵀW - I‖ assumes rbit = d; for rbit > d the columns cannot be
  orthonormal, so the d x d Gram WWᵀ is pulled to (rbit/d)·I (a tight frame: unit columns on
  average, spread evenly); for rbit <= d it is HATA's WᵀW vs I.
- HATA's scheduler (ExponentialLR 0.998) is created but never stepped in its code; none here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from smartgen.selectors.base import FIRST_SPARSE_LAYER, ModelInfo
from smartgen.selectors.hata import DEFAULT_RBIT, HashWeights

__all__ = ["HashTrainingConfig", "HashItems", "training_items", "hash_loss", "train_hash_weights"]

# per layer: post-RoPE queries [Hq, n, d] and keys [H, n, d] of one calibration prompt
PromptQK = tuple[Mapping[int, torch.Tensor], Mapping[int, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class HashTrainingConfig:
    rbit: int = DEFAULT_RBIT
    steps: int = 300  # HATA's script: 15 epochs x 20 iterations
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 1e-6
    epsilon: float = 0.01
    lam: float = 1.0
    eta: float = 2.0
    sigma: float = 0.1
    positive_ratio: float = 0.1
    queries_per_prompt: int = 2
    keys_per_query: int = 256
    keep_top: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rbit % 8 or self.rbit < 8:
            raise ValueError(f"rbit must be a positive multiple of 8, got {self.rbit}")
        if not 0 < self.positive_ratio < 1:
            raise ValueError(f"positive_ratio must be in (0, 1), got {self.positive_ratio}")


@dataclass(frozen=True, slots=True)
class HashItems:
    """Training pairs of one layer, grouped by query position u: query u is paired with its K keys.

    queries [U, Hq, d], keys [U, H, K, d], weights [U, Hq, K] (0 where a query has fewer than K keys),
    valid [U, K] bool.
    """

    queries: torch.Tensor
    keys: torch.Tensor
    weights: torch.Tensor
    valid: torch.Tensor

    @staticmethod
    def cat(parts: list[HashItems]) -> HashItems:
        width = max(p.keys.shape[2] for p in parts)

        def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            shape = list(t.shape)
            shape[dim] = width - t.shape[dim]
            return torch.cat([t, t.new_zeros(shape)], dim=dim)

        return HashItems(
            torch.cat([p.queries for p in parts]),
            torch.cat([pad(p.keys, 2) for p in parts]),
            torch.cat([pad(p.weights, 2) for p in parts]),
            torch.cat([pad(p.valid, 1) for p in parts]),
        )


def training_items(
    queries: torch.Tensor, keys: torch.Tensor, config: HashTrainingConfig, generator: torch.Generator
) -> HashItems:
    """Items of one prompt and layer from its post-RoPE queries [Hq, n, d] and keys [H, n, d]."""
    num_q, n, dim = queries.shape
    heads = keys.shape[0]
    group = num_q // heads
    parts = []
    for _ in range(config.queries_per_prompt):
        p = int(torch.randint(max(1, n // 2), n, (1,), generator=generator))
        q = queries[:, p]  # [Hq, d]
        logits = torch.einsum("hgd,hnd->hgn", q.view(heads, group, dim), keys[:, :p]).reshape(num_q, p)
        num_pos = max(1, int(p * config.positive_ratio))
        order = logits.argsort(dim=-1, descending=True)  # [Hq, p]
        weight = torch.full((num_q, p), -1.0)
        weight.scatter_(1, order[:, :num_pos], torch.linspace(20, 1, num_pos).expand(num_q, -1))
        forced = torch.zeros(p, dtype=torch.bool)
        forced[order[:, : config.keep_top].flatten()] = True
        rest = (~forced).nonzero().flatten()
        room = max(0, config.keys_per_query - int(forced.sum()))
        sampled = rest[torch.randperm(rest.numel(), generator=generator)[:room]]
        rate = sampled.numel() / rest.numel() if rest.numel() else 1.0
        picked = torch.cat([forced.nonzero().flatten(), sampled])
        scale = torch.cat([torch.ones(int(forced.sum())), torch.full((sampled.numel(),), 1 / rate)])
        parts.append(
            HashItems(
                q[None],
                keys[:, picked][None],
                (weight[:, picked] * scale)[None],
                torch.ones(1, picked.numel(), dtype=torch.bool),
            )
        )
    return HashItems.cat(parts)


def hash_loss(weight: torch.Tensor, items: HashItems, config: HashTrainingConfig) -> torch.Tensor:
    """HATA's loss for one layer and hash weights [H, d, rbit] (a scalar).

    ‖c_q - c_k‖² is expanded as ‖c_q‖² + ‖c_k‖² - 2·c_q·c_k, so each query is encoded once, not once per key.
    """
    heads, dim, rbit = weight.shape
    num_u, num_q, _ = items.queries.shape
    group = num_q // heads
    valid = items.valid[:, None, :].float()  # [U, 1, K]
    num_items = items.valid.sum()
    q_code = 2 * torch.sigmoid(config.sigma * (items.queries.view(num_u, heads, group, dim) @ weight)) - 1
    k_code = 2 * torch.sigmoid(config.sigma * (items.keys @ weight[None])) - 1  # [U, H, K, rbit]
    dots = (q_code @ k_code.transpose(-1, -2)).reshape(num_u, num_q, -1)  # [U, Hq, K]
    q_norm = q_code.pow(2).sum(dim=-1).reshape(num_u, num_q, 1)  # [U, Hq, 1]
    k_norm = k_code.pow(2).sum(dim=-1).repeat_interleave(group, dim=1)  # [U, Hq, K]
    distance = (q_norm + k_norm - 2 * dots) * valid
    similarity = config.epsilon * (items.weights * distance).sum() / num_items
    per_query = items.valid.sum(dim=1).float()[:, None, None]  # [U, 1, 1] keys paired with each query
    code_sum = (q_code.reshape(num_u, num_q, rbit) * per_query).sum(dim=0)  # [Hq, rbit]
    code_sum = code_sum + (k_code * items.valid[:, None, :, None]).sum(dim=(0, 2)).repeat_interleave(group, dim=0)
    balance = config.lam * (code_sum / num_items / rbit).pow(2).sum()
    if rbit <= dim:
        gram, eye = weight.transpose(1, 2) @ weight, torch.eye(rbit)
    else:
        gram, eye = weight @ weight.transpose(1, 2), torch.eye(dim) * (rbit / dim)
    decorrelation = config.eta * torch.linalg.norm(gram - eye)
    return similarity + balance + decorrelation


def train_hash_weights(
    info: ModelInfo,
    prompts: Iterable[PromptQK],
    config: HashTrainingConfig | None = None,
    on_progress: Callable[[int, float], None] | None = None,
) -> HashWeights:
    """Hash weights {layer: W [H, d, rbit]} for every layer >= 2, trained on the calibration prompts' q/k.

    `prompts` yields, per calibration prompt, (queries, keys) by layer (`runtime.prefill.capture_qk`).
    `on_progress(layer, final loss)` is called once per trained layer.
    """
    config = config or HashTrainingConfig()
    generator = torch.Generator().manual_seed(config.seed)
    layers = range(FIRST_SPARSE_LAYER, info.num_layers)
    items: dict[int, list[HashItems]] = {layer: [] for layer in layers}
    for queries, keys in prompts:
        for layer in layers:
            if layer in queries:
                items[layer].append(training_items(queries[layer].float(), keys[layer].float(), config, generator))
    weights: HashWeights = {}
    for layer in layers:
        if not items[layer]:
            raise ValueError(f"no calibration queries for layer {layer}")
        data = HashItems.cat(items[layer])
        weight = torch.randn(info.num_kv_heads, info.head_dim, config.rbit, generator=generator).requires_grad_()
        optimizer = torch.optim.SGD([weight], lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
        with torch.enable_grad():
            for _ in range(config.steps):
                optimizer.zero_grad()
                loss = hash_loss(weight, data, config)
                loss.backward()
                optimizer.step()
        weights[layer] = weight.detach().clone()
        if on_progress is not None:
            on_progress(layer, float(loss.detach()))
    return weights
