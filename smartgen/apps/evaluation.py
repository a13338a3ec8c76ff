"""Runs evaluation-suite samples through the disaggregated pipeline under a transfer scheme and scores them.

Schemes (docs/eval.md says how to read the results):
- full-cache: dense selection, full transfer. The reference the others are compared with.
- smartgen: the given selector; a proactive set (the profile's importance, else the streaming
  strategy), then on-demand fetches and speculation. Transfers are lossless, so this scores what
  the selector scores with all KV local.
- proactive-only: the given selector; only the proactive set (K_r blocks) is sent. Remote entries
  are dropped, never fetched.
- streamingllm: 4 sink tokens + the most recent prompt tokens (the budget in all), full transfer.
- quant2: dense selection, full transfer, each layer's K/V quantized at the prefill hand-off (KIVI-like).

K_r needs T_p and T_t. Serving would run on a link where a full KV transfer takes `stall_ratio` x the
prefill (default 4.7, the paper's testbed), so T_t = stall_ratio x T_p: proactive-only really drops
what such a link cannot carry during prefill, on any machine. `stall_ratio=None` uses a profile's
measured T_p and T_t instead (on a CPU with a fast loopback those send every block during prefill).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from smartgen.apps.evalsuite import TASKS, Sample, generate_task, score_sample
from smartgen.apps.quantization import KVQuantConfig, KVQuantizer
from smartgen.engine.layout import DEFAULT_NUM_BLOCKS, effective_blocks
from smartgen.engine.policy import Policy, get_policy
from smartgen.runtime.pipeline import InprocPipeline
from smartgen.selectors import selector_kind

__all__ = [
    "SCHEMES",
    "Condition",
    "SampleResult",
    "SchemeRun",
    "EvalReport",
    "evaluate",
    "evaluate_conditions",
    "StoreProfiles",
    "wilson_interval",
    "parse_selector_spec",
]

SCHEMES = ("full-cache", "smartgen", "proactive-only", "streamingllm", "quant2")
REFERENCE = "full-cache"
STREAMING_SINKS = 4
DEFAULT_STALL_RATIO = 4.7  # full transfer time / prefill time on the paper's testbed (25-32 Gbit/s)
LEARNED_PARAMS = ("skew", "weights")  # tensors learned offline (InfiniGen, HATA): never echoed in reports
PREFILL_SECONDS_PER_TOKEN = 1e-4  # without a profile only T_t / T_p matters to K_r

ProgressFn = Callable[[int, int, str], None]  # (samples done, total, label of the running condition)
ProfileSource = Callable[[int], Any]  # prompt length -> a store Profile (importance, T_p, T_t)


def wilson_interval(mean: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval (95% for z = 1.96) of a success rate `mean` over `n` prompts.

    Fractional scores (string_match_all over several references) count as n·mean successes: an
    approximation, exact for the 0/1 scores of passkey and single-answer tasks.
    """
    if n <= 0:
        return 0.0, 1.0
    z2 = z * z
    center = (mean + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * (mean * (1 - mean) / n + z2 / (4 * n * n)) ** 0.5
    return max(0.0, center - half), min(1.0, center + half)


def budget_label(budget: float) -> str:
    return f"{budget:.0%}" if budget <= 1 else f"{budget:g} tok"


@dataclass(frozen=True, slots=True)
class Condition:
    """One column of the table: a scheme, and the selector and budget of the schemes that select."""

    scheme: str
    selector: str = "quest"
    budget: float = 0.1
    options: tuple[tuple[str, Any], ...] = ()  # the selector's own parameters besides the budget, sorted

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {self.scheme!r}; choose from {', '.join(SCHEMES)}")
        if self.budget <= 0:
            raise ValueError(f"budget must be positive, got {self.budget:g}")

    @property
    def label(self) -> str:
        if self.scheme in (REFERENCE, "quant2"):
            return self.scheme
        if self.scheme == "streamingllm":
            return f"streamingllm {budget_label(self.budget)}"
        options = f"({','.join(f'{k}={v}' for k, v in self.options)})" if self.options else ""
        return f"{self.scheme} {self.selector}{options} {budget_label(self.budget)}"


def parse_selector_spec(text: str) -> tuple[str, dict[str, Any]]:
    """A selector and its own parameters: 'quest:page_size=4;x=true' -> ('quest', {'page_size': 4, 'x': True})."""
    name, _, rest = text.strip().partition(":")
    params: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(";"))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"selector parameters are key=value pairs separated by ';', got {item!r} in {text!r}")
        lowered = value.strip().lower()
        if lowered in ("true", "false"):
            params[key.strip()] = lowered == "true"
            continue
        for kind in (int, float):
            try:
                params[key.strip()] = kind(value)
                break
            except ValueError:
                continue
        else:
            params[key.strip()] = value.strip()
    return name.strip(), params


@dataclass(frozen=True, slots=True)
class SampleResult:
    task: str
    length: int
    depth: float
    seed: int
    prediction: str
    score: float
    prompt_tokens: int
    new_tokens: int
    selected_entries: int  # KV entries attended over all decode steps and layers (after any drop)
    remote_entries: int  # of those, entries that were remote when selected (fetched on demand)
    fetched_tokens: int


@dataclass(slots=True)
class SchemeRun:
    """One condition over every sample."""

    label: str
    scheme: str
    selector: str
    selector_params: dict[str, Any]
    results: list[SampleResult] = field(default_factory=list)
    strategy: str | None = None  # the proactive set's strategy (budgeted schemes): profile or streaming
    profile_ids: list[int] = field(default_factory=list)
    proactive_shares: list[float] = field(default_factory=list)  # K_r / all blocks, per sample
    kv_byte_ratio: float | None = None  # quantized transfer bytes / fp16 (quant2)
    seconds: float = 0.0
    recall: dict[str, Any] | None = None  # selector_recall.recall_summary against the exact top-k
    # proactive-only: prompt length -> bool [L, n], the prompt tokens its proactive set leaves on the decode node
    local_mask: Callable[[int], torch.Tensor] | None = None

    def accuracy(self) -> dict[tuple[str, int], float]:
        scores: dict[tuple[str, int], list[float]] = defaultdict(list)
        for r in self.results:
            scores[(r.task, r.length)].append(r.score)
        return {cell: sum(v) / len(v) for cell, v in scores.items()}

    def overall(self) -> float:
        return sum(r.score for r in self.results) / len(self.results) if self.results else 0.0

    def intervals(self) -> dict[tuple[str, int], tuple[float, float]]:
        """95% Wilson interval of each cell's accuracy."""
        counts: dict[tuple[str, int], int] = defaultdict(int)
        for r in self.results:
            counts[(r.task, r.length)] += 1
        return {cell: wilson_interval(acc, counts[cell]) for cell, acc in self.accuracy().items()}

    def overall_interval(self) -> tuple[float, float]:
        return wilson_interval(self.overall(), len(self.results))

    @property
    def proactive_share(self) -> float | None:
        return sum(self.proactive_shares) / len(self.proactive_shares) if self.proactive_shares else None

    def to_json(self) -> dict[str, Any]:
        return {
            "scheme": self.scheme,
            "selector": self.selector,
            "selector_params": self.selector_params,
            "strategy": self.strategy,
            "profile_ids": self.profile_ids,
            "proactive_share": self.proactive_share,
            "kv_byte_ratio": self.kv_byte_ratio,
            "seconds": round(self.seconds, 2),
            "overall": self.overall(),
            "accuracy": {f"{task}@{length}": acc for (task, length), acc in self.accuracy().items()},
            "ci95": {f"{task}@{length}": list(ci) for (task, length), ci in self.intervals().items()},
            "overall_ci95": list(self.overall_interval()),
            "oracle_recall": self.recall,
            "samples": [asdict(r) for r in self.results],
        }


@dataclass(slots=True)
class EvalReport:
    """Runs by label; accuracy per (task, length) cell, overall, and relative to the full cache when it ran."""

    runs: dict[str, SchemeRun] = field(default_factory=dict)

    def cells(self) -> list[tuple[str, int]]:
        found = {(r.task, r.length) for run in self.runs.values() for r in run.results}
        return sorted(found, key=lambda c: (TASKS.index(c[0]) if c[0] in TASKS else len(TASKS), c[0], c[1]))

    @property
    def reference(self) -> SchemeRun | None:
        return next((run for run in self.runs.values() if run.scheme == REFERENCE), None)

    def relative(self, label: str) -> dict[tuple[str, int], float | None]:
        """accuracy / full-cache accuracy per cell (None where the full cache scored 0 or did not run)."""
        ref = self.reference
        if ref is None:
            return {}
        ref_acc = ref.accuracy()
        return {
            cell: (acc / ref_acc[cell] if ref_acc.get(cell) else None)
            for cell, acc in self.runs[label].accuracy().items()
        }

    def relative_overall(self, label: str) -> float | None:
        ref = self.reference
        return None if ref is None or not ref.overall() else self.runs[label].overall() / ref.overall()

    def merge(self, other: EvalReport) -> EvalReport:
        return EvalReport({**self.runs, **other.runs})

    def to_json(self) -> dict[str, Any]:
        runs = {}
        for label, run in self.runs.items():
            runs[label] = run.to_json() | {
                "relative": {f"{t}@{n}": v for (t, n), v in self.relative(label).items()},
                "relative_overall": self.relative_overall(label),
            }
        return {"cells": [f"{t}@{n}" for t, n in self.cells()], "reference": REFERENCE, "runs": runs}


class StoreProfiles:
    """Profiles of one model from the profile store, for each (selector, budget) the evaluation runs."""

    def __init__(self, db: Path | str | None, model: torch.nn.Module, num_blocks: int) -> None:
        from smartgen.runtime.fingerprint import model_fingerprint
        from smartgen.store import ProfileStore

        self.store = ProfileStore(db, create=False)
        self.fingerprint = model_fingerprint(model)
        self.num_blocks = num_blocks

    def source(self, selector: str, budget: float) -> ProfileSource | None:
        """length -> Profile, preferring profiles made at this budget; None when the store has none."""
        candidates = [
            p
            for p in self.store.list(fingerprint=self.fingerprint, selector=selector)
            if p.num_blocks == self.num_blocks
        ]
        if not candidates:
            return None
        params = next((p.selector_params for p in candidates if p.selector_params.get("budget") == budget), None)
        return lambda length: self.store.best(self.fingerprint, selector, self.num_blocks, length, params).profile

    def close(self) -> None:
        self.store.close()


def _setup(
    cond: Condition, params: dict[str, Any], quant: KVQuantConfig | None
) -> tuple[Policy, str, dict, KVQuantizer | None]:
    """(policy, selector, its params, K/V transform) of a condition; budgeted policies get their strategy later."""
    if cond.scheme == REFERENCE:
        return get_policy("full"), "dense", {}, None
    if cond.scheme == "quant2":
        return get_policy("full"), "dense", {}, KVQuantizer(quant or KVQuantConfig())
    if cond.scheme == "streamingllm":
        return get_policy("full"), "streaming", {"budget": cond.budget, "sinks": STREAMING_SINKS}, None
    if cond.scheme == "smartgen":
        # without the prefill node's head start: its steps pick as the decode node's would (the same answers), but
        # the report's selection and fetch counts are the decode node's, which would then see few steps or none
        return get_policy("smartgen-no-head-start"), cond.selector, params, None
    return get_policy("proactive-only"), cond.selector, params, None


def _prompt_ids(tokenizer, sample: Sample) -> list[int]:
    return list(tokenizer(sample.prompt, add_special_tokens=True)["input_ids"])


def infinigen_warmup(model, tokenizer, samples: Sequence[Sample]) -> dict[int, torch.Tensor]:
    """InfiniGen's offline skewing from one calibration-variant prompt (never an evaluated one)."""
    from smartgen.runtime.prefill import infinigen_skewing

    first = samples[0]
    return infinigen_skewing(
        model, _prompt_ids(tokenizer, generate_task(first.task, first.length, 0, tokenizer, "calibration"))
    )


def hata_calibration(model, tokenizer, samples: Sequence[Sample], prompts_per_cell: int = 2) -> dict[int, torch.Tensor]:
    """HATA hash weights trained on calibration-variant prompts of the samples' tasks and lengths (never evaluated ones)."""
    from smartgen.runtime.models import model_info
    from smartgen.runtime.prefill import capture_qk
    from smartgen.selectors.hata_train import train_hash_weights

    cells = sorted({(s.task, s.length) for s in samples})
    prompts = (
        capture_qk(model, _prompt_ids(tokenizer, generate_task(task, length, seed, tokenizer, "calibration")))
        for task, length in cells
        for seed in range(prompts_per_cell)
    )
    return train_hash_weights(model_info(model), prompts)


def evaluate(
    model,
    tokenizer,
    samples: Sequence[Sample],
    scheme: str,
    selector: str = "quest",
    selector_params: dict | None = None,
    *,
    importance: torch.Tensor | None = None,
    profiles: ProfileSource | None = None,
    num_blocks: int = DEFAULT_NUM_BLOCKS,
    stall_ratio: float | None = DEFAULT_STALL_RATIO,
    quant: KVQuantConfig | None = None,
    batch_size: int = 4,
    on_progress: ProgressFn | None = None,
) -> EvalReport:
    """Greedy answers to `samples` under one scheme, scored as RULER does.

    selector_params["budget"] is also StreamingLLM's window. `profiles` (length -> Profile) gives the
    proactive set's importance (else `importance` [L, M], else the streaming strategy). K_r follows
    T_t = stall_ratio x T_p; `stall_ratio=None` takes T_p and T_t from the profile (the default ratio
    without one).
    """
    params = dict(selector_params or {})
    options = tuple(sorted((k, v) for k, v in params.items() if k != "budget" and k not in LEARNED_PARAMS))
    kind = selector_kind(selector)
    cond = Condition(scheme, selector, float(params.get("budget", 0.1)), options if kind.sparse else ())
    if (
        kind.needs_warmup
        and cond.scheme in ("smartgen", "proactive-only")
        and "skew" not in params
        and params.get("skewing", True)
    ):
        params["skew"] = infinigen_warmup(model, tokenizer, samples)
    if kind.needs_training and cond.scheme in ("smartgen", "proactive-only") and "weights" not in params:
        params["weights"] = hata_calibration(model, tokenizer, samples)
    policy, selector_name, params, quantizer = _setup(cond, params if kind.sparse else {}, quant)
    if importance is not None and importance.shape[1] != num_blocks:
        raise ValueError(f"importance has {importance.shape[1]} blocks per layer, num_blocks is {num_blocks}")
    run = SchemeRun(cond.label, scheme, selector_name, {k: v for k, v in params.items() if k not in LEARNED_PARAMS})
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, sample in enumerate(samples):
        by_length[sample.length].append(i)
    ids = [_prompt_ids(tokenizer, s) for s in samples]
    results: dict[int, SampleResult] = {}
    start = time.monotonic()
    for length, members in by_length.items():
        profile = profiles(length) if profiles is not None and policy.proactive == "budget" else None
        weights = importance if profile is None else profile.importance
        if profile is not None and profile.id is not None and profile.id not in run.profile_ids:
            run.profile_ids.append(profile.id)
        chosen = policy if policy.proactive != "budget" or weights is not None else policy.with_strategy("streaming")
        run.strategy = chosen.strategy if chosen.proactive == "budget" else None
        t_p, t_t = _timings(profile, stall_ratio)
        blocks = num_blocks if weights is None else weights.shape[1]
        if policy.drop_remote and run.local_mask is None:
            run.local_mask = _proactive_tokens(model, weights, blocks, t_p, t_t, chosen.strategy)
        with InprocPipeline(
            model,
            chosen,
            selector_name,
            params,
            importance=weights,
            prefill_seconds_per_token=t_p,
            transfer_seconds_per_token=t_t,
            num_blocks=blocks,
            max_batch=batch_size,
            kv_transform=quantizer,
            max_tokens=max(len(ids[i]) + samples[i].max_new_tokens for i in members) + 1,
        ) as pipeline:
            for batch in _batches(samples, members, batch_size):
                outputs = pipeline.generate(
                    [ids[i] for i in batch], samples[batch[0]].max_new_tokens, eos_token_id=tokenizer.eos_token_id
                )
                for i, out in zip(batch, outputs):
                    results[i] = _result(tokenizer, samples[i], len(ids[i]), out)
                    if chosen.proactive == "budget":  # K_r over all blocks of this prompt
                        total = pipeline.layout.num_layers * effective_blocks(len(ids[i]), blocks)
                        run.proactive_shares.append(pipeline.planner.budget(len(ids[i]), "budget") / total)
                if on_progress is not None:
                    on_progress(len(results), len(samples), cond.label)
    run.results = [results[i] for i in range(len(samples))]
    run.seconds = time.monotonic() - start
    run.kv_byte_ratio = quantizer.byte_ratio if quantizer is not None else None
    return EvalReport({run.label: run})


def _proactive_tokens(model, importance, num_blocks: int, t_p: float, t_t: float, strategy: str):
    """n -> bool [L, n]: the prompt tokens of each layer a proactive-only decode node holds (its proactive set).

    The run's own planner settings; with a profile, those of the first length (recall is an estimate).
    """
    from smartgen.engine.layout import block_bounds
    from smartgen.engine.planning import Planner
    from smartgen.runtime.models import model_info

    layers = model_info(model).num_layers
    planner = Planner(layers, num_blocks, importance, t_p, t_t)

    def local(n: int) -> torch.Tensor:
        plan = planner.plan(n, "budget", strategy)
        bounds = block_bounds(n, num_blocks)
        mask = torch.zeros(layers, n, dtype=torch.bool)
        for layer in range(layers):
            for block in plan.proactive_blocks(layer).tolist():
                mask[layer, bounds[block] : bounds[block + 1]] = True
        return mask

    return local


def _timings(profile, stall_ratio: float | None) -> tuple[float, float]:
    """T_p and T_t per token: T_t = stall_ratio x T_p, or the profile's own pair when stall_ratio is None."""
    if stall_ratio is not None and stall_ratio <= 0:
        raise ValueError(f"the stall ratio must be positive, got {stall_ratio:g}")
    t_p = PREFILL_SECONDS_PER_TOKEN if profile is None else profile.prefill_seconds_per_token
    if profile is not None and stall_ratio is None:
        return t_p, profile.transfer_seconds_per_token
    return t_p, t_p * (stall_ratio or DEFAULT_STALL_RATIO)


def evaluate_conditions(
    model,
    tokenizer,
    samples: Sequence[Sample],
    conditions: Sequence[Condition],
    *,
    profiles: StoreProfiles | None = None,
    on_progress: ProgressFn | None = None,
    hata_weights: dict[int, torch.Tensor] | None = None,
    recall_prompts: int = 0,
    **kwargs: Any,
) -> EvalReport:
    """`evaluate` for each condition in turn (what `smartgen eval` runs); progress counts over all of them.

    HATA runs with `hata_weights`, else with weights trained once on calibration-variant prompts.
    `recall_prompts` > 0: then the first that many prompts of each cell are traced densely and every
    selecting condition's recall of the exact top-k (same budget) is added to its run (`SchemeRun.recall`).
    """
    report = EvalReport()
    selecting: dict[str, tuple[str, dict[str, Any], float]] = {}
    skew: dict[int, torch.Tensor] | None = None
    total = len(samples) * len(conditions)
    for n, cond in enumerate(conditions):
        params: dict[str, Any] = {"budget": cond.budget, **dict(cond.options)}
        kind = selector_kind(cond.selector)
        if kind.needs_warmup and cond.scheme in ("smartgen", "proactive-only") and params.get("skewing", True):
            skew = skew if skew is not None else infinigen_warmup(model, tokenizer, samples)
            params["skew"] = skew
        if kind.needs_training and cond.scheme in ("smartgen", "proactive-only"):
            hata_weights = hata_weights if hata_weights is not None else hata_calibration(model, tokenizer, samples)
            params["weights"] = hata_weights
        source = (
            profiles.source(cond.selector, cond.budget)
            if profiles is not None and cond.scheme in ("smartgen", "proactive-only")
            else None
        )
        progress = (
            (lambda done, _, label, base=n * len(samples): on_progress(base + done, total, label))
            if on_progress
            else None
        )
        report = report.merge(
            evaluate(
                model,
                tokenizer,
                samples,
                cond.scheme,
                cond.selector,
                params,
                profiles=source,
                on_progress=progress,
                **kwargs,
            )
        )
        if cond.scheme in ("smartgen", "proactive-only"):
            selecting[cond.label] = (cond.selector, params, cond.budget)
        elif cond.scheme == "streamingllm":
            selecting[cond.label] = ("streaming", {"budget": cond.budget, "sinks": STREAMING_SINKS}, cond.budget)
    if recall_prompts > 0 and selecting:
        add_oracle_recall(model, tokenizer, samples, report, selecting, recall_prompts, on_progress)
    return report


def recall_samples(samples: Sequence[Sample], per_cell: int) -> list[Sample]:
    """The first `per_cell` samples of each (task, length) cell whose answer is a needle in the prompt."""
    taken: dict[tuple[str, int], int] = defaultdict(int)
    chosen = []
    for sample in samples:
        cell = (sample.task, sample.length)
        if sample.needle_spans and taken[cell] < per_cell:
            taken[cell] += 1
            chosen.append(sample)
    return chosen


def add_oracle_recall(
    model,
    tokenizer,
    samples: Sequence[Sample],
    report: EvalReport,
    selecting: dict[str, tuple[str, dict[str, Any], float]],
    per_cell: int,
    on_progress: ProgressFn | None = None,
) -> None:
    """Sets `recall` on each labelled run: its selector (with what proactive-only holds) against the exact top-k."""
    from smartgen.apps.selector_recall import oracle_recall, recall_summary, retrieval_heads
    from smartgen.runtime.models import model_info
    from smartgen.selectors import make_selector

    info = model_info(model)
    traced = recall_samples(samples, per_cell)
    if not traced:
        return
    selectors = {
        label: (make_selector(name, info, **params), budget, report.runs[label].local_mask)
        for label, (name, params, budget) in selecting.items()
    }
    progress = (lambda done, total: on_progress(done, total, "oracle recall")) if on_progress else None
    stats = oracle_recall(model, tokenizer, traced, selectors, progress)
    heads = retrieval_heads(next(iter(stats.values())))  # full attention's needle mass: the same in every run
    for label, run_stats in stats.items():
        report.runs[label].recall = recall_summary(run_stats, heads) | {"prompts": len(traced)}


def _batches(samples: Sequence[Sample], members: list[int], size: int) -> list[list[int]]:
    """`members` (indices into samples) in batches of one task each, so a batch has one max_new_tokens."""
    by_task: dict[str, list[int]] = defaultdict(list)
    for i in members:
        by_task[samples[i].task].append(i)
    return [idx[j : j + size] for idx in by_task.values() for j in range(0, len(idx), size)]


def _result(tokenizer, sample: Sample, prompt_tokens: int, out) -> SampleResult:
    prediction = tokenizer.decode(out.tokens, skip_special_tokens=True)
    m = out.metrics
    return SampleResult(
        sample.task,
        sample.length,
        sample.depth,
        sample.seed,
        prediction,
        score_sample(sample, prediction),
        prompt_tokens,
        len(out.tokens),
        m.selected_entries,
        m.remote_entries,
        m.fetched_tokens,
    )
