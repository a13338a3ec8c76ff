"""Oracle recall: how much of the exact top-k's choice a selector picks, per layer and head, on real decode steps.

A `DecodeTrace` is one prompt and its continuation run densely once (teacher forcing), with every
layer's post-RoPE q/k and attention input kept. Replaying it, each decode step (the continuation's
tokens but the last, at positions n .. n+T-2, as the decode node feeds them) asks a selector for its
index and compares it with the oracle at the same budget (`ExactTopKSelector`'s score: per KV head the
max over its G query heads of the softmax probability over the prompt). `RecallStats` sums over steps
and prompts:

- kv_recall [L, H]: |selected ∩ oracle top-k| / k for the KV head's row;
- head_recall [L, Hq]: the same against each query head's own top-k (the row is its KV head's);
- mass [L, Hq]: the query head's attention probability (over the prompt) on the selected tokens;
  oracle_mass the same on its own top-k: 1 - mass is what the selection takes from that head;
- top1_hit [L, Hq]: whether the head's single most attended prompt token is in its row (a retrieval head
  that puts ~all its weight on the next needle token loses the answer when it is not);
- needle_hit [L, Hq]: share of the answer needle's tokens in the head's row (prompts with a needle);
- needle_mass [L, Hq]: full attention's probability on the needle: the retrieval heads are the
  heads with the largest (see `retrieval_heads`);
- size [L, H]: row length / k (InfiniGen's threshold can pick fewer than the budget).
Layers below `first_layer` (2: dense in SmartGen) are not scored. `local` [L, n] restricts the
selector's rows to the tokens a decode node holds (proactive-only drops the rest).

`trace_sample` traces one eval-suite prompt with its dense greedy answer; `oracle_recall` runs several
selectors over shared traces and `recall_summary` turns stats into the figures `smartgen eval` reports.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers import PreTrainedModel

from smartgen.selectors.base import PrefillLayer, Selector, StepQuery, budget_tokens

__all__ = [
    "DecodeTrace",
    "RecallStats",
    "trace_decode",
    "trace_sample",
    "selector_recall",
    "oracle_recall",
    "recall_summary",
    "retrieval_heads",
    "FIRST_SCORED_LAYER",
]

FIRST_SCORED_LAYER = 2


@dataclass(slots=True)
class DecodeTrace:
    """One dense forward pass over prompt + continuation: per layer q [Hq, T, d], k [H, T, d], hidden [T, D]."""

    prompt_length: int
    queries: dict[int, torch.Tensor]
    keys: dict[int, torch.Tensor]
    hidden: dict[int, torch.Tensor]
    scale: float  # the attention's softmax scale
    needle: torch.Tensor | None = None  # bool [n] over the prompt: the answer needle's tokens

    @property
    def steps(self) -> range:
        """Positions fed as decode steps: the continuation's tokens but the last."""
        total = next(iter(self.queries.values())).shape[1]
        return range(self.prompt_length, total - 1)


class _Recorder:
    def __init__(self) -> None:
        self.queries: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.scale = 1.0

    def attend(self, module, query, key, value, attention_mask, **kwargs: Any):
        from smartgen.runtime.hooks import dense_attention

        self.queries[module.layer_idx] = query[0].detach().float()  # [Hq, T, d]
        self.keys[module.layer_idx] = key[0].detach().float()  # [H, T, d]
        self.scale = float(kwargs.get("scaling") or query.shape[-1] ** -0.5)
        return dense_attention(module, query, key, value, attention_mask, **kwargs)


@torch.no_grad()
def trace_decode(
    model: PreTrainedModel,
    prompt_ids: list[int] | torch.Tensor,
    continuation: list[int] | torch.Tensor,
    needle: torch.Tensor | None = None,
) -> DecodeTrace:
    """Runs prompt + continuation through `model` (loaded with SmartGen's attention hook) and records it."""
    from smartgen.runtime.capture import HiddenCapture
    from smartgen.runtime.hooks import use_handler

    prompt = torch.as_tensor(prompt_ids, dtype=torch.int64).flatten()
    ids = torch.cat([prompt, torch.as_tensor(continuation, dtype=torch.int64).flatten()]).view(1, -1)
    recorder, capture = _Recorder(), HiddenCapture(model)
    capture.start()
    try:
        with use_handler(recorder):
            model(input_ids=ids.to(model.device), use_cache=False, logits_to_keep=1)
        hidden = {}
        for layer in recorder.queries:
            captured = capture.get(layer)
            assert captured is not None, "the capture hook records every layer the model ran"
            hidden[layer] = captured[0].detach().float()
    finally:
        capture.stop()
        capture.remove()
    return DecodeTrace(int(prompt.numel()), recorder.queries, recorder.keys, hidden, recorder.scale, needle)


@dataclass(slots=True)
class RecallStats:
    """Sums over decode steps (and prompts) of the per-head figures in the module docstring; `mean()` divides."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    counts: dict[str, torch.Tensor] = field(default_factory=dict)

    KV_FIELDS = ("kv_recall", "size")
    Q_FIELDS = ("head_recall", "mass", "oracle_mass", "top1_hit", "needle_hit", "needle_mass")

    def __post_init__(self) -> None:
        for name in self.KV_FIELDS + self.Q_FIELDS:
            heads = self.num_kv_heads if name in self.KV_FIELDS else self.num_q_heads
            self.sums.setdefault(name, torch.zeros(self.num_layers, heads, dtype=torch.float64))
            self.counts.setdefault(name, torch.zeros(self.num_layers, 1, dtype=torch.float64))

    def add(self, name: str, layer: int, values: torch.Tensor) -> None:
        self.sums[name][layer] += values.double().cpu()
        self.counts[name][layer] += 1

    def merge(self, other: RecallStats) -> RecallStats:
        out = RecallStats(self.num_layers, self.num_q_heads, self.num_kv_heads)
        for name in out.sums:
            out.sums[name] = self.sums[name] + other.sums[name]
            out.counts[name] = self.counts[name] + other.counts[name]
        return out

    def mean(self, name: str) -> torch.Tensor:
        """[L, heads] mean per layer and head (NaN where a layer was never scored)."""
        return self.sums[name] / self.counts[name]

    def overall(self, name: str, heads: list[tuple[int, int]] | None = None) -> float:
        """Mean over scored layers and heads, or over the given (layer, head) pairs."""
        values = self.mean(name)
        if heads is not None:
            return float(torch.stack([values[layer, head] for layer, head in heads]).mean())
        return float(values[values.isfinite()].mean())


def retrieval_heads(stats: RecallStats, threshold: float = 0.1) -> list[tuple[int, int]]:
    """(layer, query head) pairs whose full attention puts at least `threshold` of its weight on the needle."""
    mass = stats.mean("needle_mass")
    found = (mass >= threshold).nonzero().tolist()
    return [(int(layer), int(head)) for layer, head in found]


def _probs(trace: DecodeTrace, layer: int, position: int) -> torch.Tensor:
    """[Hq, n] each query head's softmax over the prompt keys at `position`."""
    n = trace.prompt_length
    q, k = trace.queries[layer][:, position], trace.keys[layer][:, :n]  # [Hq, d], [H, n, d]
    heads = k.shape[0]
    logits = torch.einsum("hgd,hnd->hgn", q.view(heads, -1, q.shape[-1]), k) * trace.scale
    return logits.softmax(dim=-1).reshape(q.shape[0], n)


@torch.no_grad()
def selector_recall(
    selector: Selector,
    budget: float,
    trace: DecodeTrace,
    stats: RecallStats | None = None,
    local: torch.Tensor | None = None,
) -> RecallStats:
    """Scores `selector` against the exact top-k at `budget` on every decode step of `trace`, adding to `stats`.

    `local` bool [L, n]: the prompt tokens held on the decode node per layer; the rest of a row is dropped.
    """
    info = selector.info
    stats = stats or RecallStats(info.num_layers, info.num_q_heads, info.num_kv_heads)
    n, heads, group = trace.prompt_length, info.num_kv_heads, info.group_size
    k = budget_tokens(budget, n)
    layers = [layer for layer in sorted(trace.queries) if layer >= FIRST_SCORED_LAYER]
    metadata = {
        layer: selector.build_metadata(
            PrefillLayer(layer, trace.queries[layer][:, :n], trace.keys[layer][:, :n], trace.hidden[layer][:n])
        )
        for layer in layers
    }
    needle = trace.needle[:n] if trace.needle is not None and trace.needle.any() else None
    for position in trace.steps:
        for layer in layers:
            hidden = trace.hidden[layer - 1][position][None] if selector.lookahead else None
            step = StepQuery(layer, trace.queries[layer][:, position][None], hidden, torch.tensor([position]), [n])
            index = selector.select(step, [metadata[layer]]).cpu()  # [H, k']
            chosen = torch.zeros(heads, n, dtype=torch.bool)
            for h in range(heads):
                row = index[h]
                chosen[h, row[row >= 0]] = True
            if local is not None:
                chosen &= local[layer, :n]
            probs = _probs(trace, layer, position)  # [Hq, n]
            kv_top = probs.view(heads, group, n).amax(dim=1).topk(k, dim=-1).indices  # [H, k]
            stats.add("kv_recall", layer, chosen.gather(1, kv_top).sum(-1) / k)
            stats.add("size", layer, chosen.sum(-1) / k)
            per_head = chosen.repeat_interleave(group, dim=0)  # [Hq, n]: a query head reads its KV head's row
            q_top = probs.topk(k, dim=-1).indices  # [Hq, k]
            stats.add("head_recall", layer, per_head.gather(1, q_top).sum(-1) / k)
            stats.add("mass", layer, (probs * per_head).sum(-1))
            stats.add("oracle_mass", layer, probs.gather(1, q_top).sum(-1))
            stats.add("top1_hit", layer, per_head.gather(1, probs.argmax(-1, keepdim=True)).squeeze(1).double())
            if needle is not None:
                stats.add("needle_hit", layer, (per_head & needle).sum(-1) / needle.sum())
                stats.add("needle_mass", layer, probs[:, needle].sum(-1))
    return stats


@torch.no_grad()
def trace_sample(model: PreTrainedModel, tokenizer, sample) -> DecodeTrace:
    """An eval-suite `Sample` answered densely (greedy), then traced with its answer needle's tokens marked."""
    enc = tokenizer(sample.prompt, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    spans = getattr(sample, "needle_spans", [])
    needle = torch.tensor(
        [b > a and any(a < e and b > s for s, e in spans) for a, b in enc["offset_mapping"]], dtype=torch.bool
    )
    generate = cast(Callable[..., torch.Tensor], model.generate)
    out = generate(
        torch.tensor([ids], device=model.device),
        max_new_tokens=sample.max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return trace_decode(model, ids, out[0, len(ids) :].cpu(), needle)


LocalMask = Callable[[int], torch.Tensor]  # prompt length n -> bool [L, n]: the tokens a decode node holds


def oracle_recall(
    model: PreTrainedModel,
    tokenizer,
    samples: Sequence,
    selectors: Mapping[str, tuple[Selector, float, LocalMask | None]],
    on_progress: Callable[[int, int], None] | None = None,
) -> dict[str, RecallStats]:
    """Each labelled (selector, budget, local mask) against the exact top-k over the samples, each traced once."""
    stats: dict[str, RecallStats] = {}
    for i, sample in enumerate(samples):
        trace = trace_sample(model, tokenizer, sample)
        for label, (selector, budget, local) in selectors.items():
            mask = local(trace.prompt_length) if local is not None else None
            stats[label] = selector_recall(selector, budget, trace, stats.get(label), mask)
        if on_progress is not None:
            on_progress(i + 1, len(samples))
    return stats


def recall_summary(stats: RecallStats, heads: list[tuple[int, int]]) -> dict[str, Any]:
    """What a report shows of one selector's stats: means over sparse layers and heads, the retrieval heads'
    figures (`heads`: (layer, query head) pairs) and the [layer x head] tables (None where not scored)."""

    def table(name: str) -> list[list[float | None]]:
        values = stats.mean(name)
        return [[round(float(v), 4) if v == v else None for v in row] for row in values.tolist()]

    def over(name: str) -> float | None:
        return round(stats.overall(name, heads), 4) if heads else None

    return {
        "recall": round(stats.overall("kv_recall"), 4),
        "mass": round(stats.overall("mass"), 4),
        "oracle_mass": round(stats.overall("oracle_mass"), 4),
        "size": round(stats.overall("size"), 4),
        "retrieval_heads": [list(h) for h in heads],
        "retrieval_recall": over("head_recall"),
        "retrieval_mass": over("mass"),
        "retrieval_oracle_mass": over("oracle_mass"),
        "retrieval_top1": over("top1_hit"),
        "retrieval_needle_hit": over("needle_hit"),
        "kv_recall_per_head": table("kv_recall"),
        "head_recall_per_head": table("head_recall"),
        "top1_hit_per_head": table("top1_hit"),
    }
