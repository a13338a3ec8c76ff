"""Calibration profiling: runs prompts through the SmartGen runtime with all KV local and turns selections into Profiles.

For every calibration prompt whose length falls in one of the length ranges:
1. prefill it (PrefillRunner inside an InprocPipeline under the "full" policy: every block is
   pushed before decoding starts, so decoding reads only local KV), timing the prefill (T_p);
2. decode `decode_tokens` steps; a `SelectionCounter` wraps the selector and counts, per layer,
   KV head and prompt token, how often `select` picked the entry (layers 0-1 are dense and never
   reach the selector, so their counts stay 0 — they are always sent whole anyway);
3. add the counts to each containing range's `ImportanceAccumulator` (block importance I[l, m]).
Per range, T_t is the full KV transfer of the mean prompt length over the link: bytes / rate
("rate:<g>gbps") or timed over a paced in-process lane ("inproc:<g>gbps").
"""

from __future__ import annotations

import hashlib
import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import PreTrainedModel

from smartgen.engine.layout import DEFAULT_NUM_BLOCKS, KVLayout
from smartgen.engine.planning import ImportanceAccumulator
from smartgen.engine.policy import get_policy
from smartgen.lanes.base import WriteOp
from smartgen.lanes.link import inproc_link
from smartgen.lanes.rate import transfer_seconds
from smartgen.runtime.fingerprint import model_fingerprint
from smartgen.runtime.models import kv_layout
from smartgen.runtime.pipeline import InprocPipeline
from smartgen.runtime.prefill import LayerSink, PrefillOutput
from smartgen.selectors import selector_kind
from smartgen.selectors.base import LayerMetadata, PrefillLayer, Selector, StepQuery
from smartgen.store.profile import Profile

__all__ = [
    "CalibrationError",
    "CalibrationSet",
    "load_calibration",
    "tokenize_calibration",
    "parse_ranges",
    "LinkSpec",
    "SelectionCounter",
    "measure_transfer",
    "profile",
    "downsample_blocks",
    "write_heatmap_png",
]

ProgressFn = Callable[[int, int], None]  # (prompts done, total)


class CalibrationError(ValueError):
    """The calibration input is missing, empty or malformed; the message says where."""


@dataclass(frozen=True, slots=True)
class CalibrationSet:
    name: str
    sha256: str  # of the file's bytes (or of the prompts' JSON when given inline)
    prompts: tuple[str, ...] | tuple[tuple[int, ...], ...]


def load_calibration(path: str | Path) -> CalibrationSet:
    """Prompts from a JSONL file: one JSON object per line with a "prompt" string (other fields ignored)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CalibrationError(f"no calibration file at {path}") from None
    except OSError as exc:
        raise CalibrationError(f"cannot read the calibration file {path}: {exc.strerror or exc}") from None
    prompts = []
    for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CalibrationError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise CalibrationError(f'{path}:{number}: expected an object with a "prompt" string')
        if record["prompt"]:
            prompts.append(record["prompt"])
    if not prompts:
        raise CalibrationError(f'{path} holds no prompts (one JSON object with a "prompt" per line)')
    return CalibrationSet(path.name, hashlib.sha256(data).hexdigest(), tuple(prompts))


def _inline_set(prompts: Sequence[str] | Sequence[Sequence[int]]) -> CalibrationSet:
    texts = tuple(p for p in prompts if isinstance(p, str))
    token_ids = tuple(tuple(int(t) for t in p) for p in prompts if not isinstance(p, str))
    if texts and token_ids:
        raise CalibrationError("calibration prompts must be all text or all token ids, not both")
    items = texts or token_ids
    if not items:
        raise CalibrationError("no calibration prompts")
    return CalibrationSet("inline", hashlib.sha256(json.dumps(items).encode()).hexdigest(), items)


def parse_ranges(text: str) -> list[tuple[int, int]]:
    """ "1024-2048,2K-4K" -> [(1024, 2048), (2048, 4096)]: half-open token ranges [lo, hi)."""

    def tokens(value: str) -> int:
        value = value.strip().lower()
        return int(float(value[:-1]) * 1024) if value.endswith("k") else int(value)

    ranges = []
    for part in (p for p in text.split(",") if p.strip()):
        try:
            lo, hi = (tokens(v) for v in part.split("-"))
        except ValueError:
            raise ValueError(f"bad length range {part.strip()!r}: use LO-HI, e.g. 1024-2048 or 1K-2K") from None
        if not 1 <= lo < hi:
            raise ValueError(f"bad length range {part.strip()!r}: needs 1 <= LO < HI")
        ranges.append((lo, hi))
    if not ranges:
        raise ValueError("no length range given, e.g. 1024-2048,2048-4096")
    return ranges


class LinkSpec(NamedTuple):
    """How T_t is obtained: "rate" = full KV bytes / gbps; "inproc" = timed over a lane paced at gbps."""

    kind: str
    gbps: float

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.gbps:g}gbps"


class SelectionCounter(Selector):
    """Wraps a selector; counts every prompt entry its `select` returns: counts [L, H, n] of the current prompt."""

    def __init__(self, inner: Selector, num_layers: int, num_kv_heads: int) -> None:
        super().__init__(inner.info)
        self.inner = inner
        self.name = inner.name
        self.lookahead = inner.lookahead
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.counts = torch.zeros(num_layers, num_kv_heads, 0)
        self.num_calls = 0
        self._lock = threading.Lock()  # a lookahead selector selects from the decode runner's worker thread

    def reset(self, length: int) -> None:
        self.counts = torch.zeros(self.num_layers, self.num_kv_heads, length, dtype=torch.float64)
        self.num_calls = 0

    def build_metadata(self, prefill: PrefillLayer) -> LayerMetadata:
        return self.inner.build_metadata(prefill)

    def select(self, step: StepQuery, metadata: list[LayerMetadata]) -> torch.Tensor:
        index = self.inner.select(step, metadata)  # [B·H, k], -1 = no entry
        if index.shape[0] != self.num_kv_heads:
            raise ValueError(f"profiling runs one prompt at a time; got an index of {index.shape[0]} rows")
        picked = index.cpu()
        valid = picked >= 0
        heads = torch.arange(self.num_kv_heads).unsqueeze(1).expand_as(picked)[valid]
        with self._lock:
            self.counts[step.layer].index_put_(
                (heads, picked[valid]), torch.ones(heads.numel(), dtype=torch.float64), accumulate=True
            )
            self.num_calls += 1
        return index


def measure_transfer(layout: KVLayout, length: int, gbps: float) -> float:
    """Seconds to move a full KV cache of `length` tokens, layer by layer, over an in-process lane paced at `gbps`."""
    layer_bytes = layout.kv_bytes(length, num_layers=1)
    prefill_end, decode_end = inproc_link(gbps, name="calibration")
    try:
        destination = torch.empty(
            layer_bytes, dtype=torch.uint8
        )  # every layer lands on the same bytes: only time counts
        decode_end.push.register_region("kv", destination)
        decode_end.push.accept("calibration")
        source = {"kv": torch.zeros(layer_bytes, dtype=torch.uint8)}
        op = [WriteOp("kv", "kv", 0, 0, layer_bytes)]
        start = time.perf_counter()
        done = [prefill_end.push.post_writes("calibration", source, op, tag="full") for _ in range(layout.num_layers)]
        timeout = 60 + 10 * transfer_seconds(layout.kv_bytes(length), gbps)
        if not all(c.wait(timeout) and c.applied for c in done):
            raise RuntimeError("the calibration transfer did not complete")
        return time.perf_counter() - start
    finally:
        prefill_end.close()
        decode_end.close()


def _json_params(params: dict[str, Any]) -> dict[str, Any]:
    """The selector parameters as stored (JSON); one that cannot be stored is a caller error, raised here."""
    try:
        return json.loads(json.dumps(params, sort_keys=True))
    except TypeError as exc:
        raise ValueError(f"selector parameters must be JSON values: {exc}") from None


def tokenize_calibration(tokenizer: Any, calibration: CalibrationSet) -> list[list[int]]:
    """The calibration prompts as token ids (text prompts through `tokenizer`, with special tokens)."""
    if not calibration.prompts or isinstance(calibration.prompts[0], tuple):
        return [list(p) for p in calibration.prompts if isinstance(p, tuple)]  # all of them: a set is one kind
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer")
    return [list(tokenizer(text, add_special_tokens=True)["input_ids"]) for text in calibration.prompts]


def _assign(
    token_ids: list[list[int]], length_ranges: Sequence[tuple[int, int]], limit: int | None
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the ranges it feeds) for every prompt that feeds at least one range, in order."""
    chosen = []
    per_range = [0] * len(length_ranges)
    for ids in token_ids:
        feeds = [
            r
            for r, (lo, hi) in enumerate(length_ranges)
            if lo <= len(ids) < hi and (limit is None or per_range[r] < limit)
        ]
        for r in feeds:
            per_range[r] += 1
        if feeds:
            chosen.append((ids, feeds))
    if not chosen:
        lengths = sorted(len(ids) for ids in token_ids)
        wanted = ", ".join(f"{lo}-{hi}" for lo, hi in length_ranges)
        raise CalibrationError(
            f"no calibration prompt falls in {wanted} (prompts have {lengths[0]}-{lengths[-1]} tokens)"
        )
    return chosen


class _Calibrator:
    """An InprocPipeline under the "full" policy whose selector is counted and whose prefill is timed."""

    def __init__(
        self, model: PreTrainedModel, selector: str | Selector, params: dict[str, Any], num_blocks: int, max_tokens: int
    ) -> None:
        full = get_policy("full")
        if isinstance(selector, str):
            self.pipeline = InprocPipeline(
                model, full, selector, params, num_blocks=num_blocks, max_batch=1, max_tokens=max_tokens
            )
            inner = self.pipeline.selector
        else:
            # the pipeline builds its runners around a named selector; one that needs no hidden states stands in
            if selector.lookahead or getattr(selector, "needs_prefill_hidden", False):
                raise ValueError("a selector instance must not need hidden states; pass lookahead selectors by name")
            self.pipeline = InprocPipeline(
                model, full, "topk", num_blocks=num_blocks, max_batch=1, max_tokens=max_tokens
            )
            inner = selector
        config = model.config
        self.counter = SelectionCounter(inner, config.num_hidden_layers, config.num_key_value_heads)
        runner = self.pipeline.prefill_runner
        self.pipeline.selector = runner.selector = self.pipeline.decode_runner.selector = self.counter
        self._prefill = runner.run
        self._prefill_seconds: list[float] = []
        # wraps this runner's bound method (the pipeline made the runner); a subclass would need a second runner
        runner.run = self._timed_prefill  # type: ignore[method-assign,assignment]

    def _timed_prefill(
        self,
        ids: torch.Tensor | list[int],
        on_layer: LayerSink | None = None,
        *,
        last_query_scores: bool = False,
        prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> PrefillOutput:
        start = time.perf_counter()  # the pipeline's caches are off: `prefix` never comes, prefill is timed whole
        output = self._prefill(ids, on_layer, last_query_scores=last_query_scores, prefix=prefix)
        self._prefill_seconds.append(time.perf_counter() - start)
        return output

    def warm_up(self, ids: list[int]) -> None:
        """One untimed prefill: first-call costs must not count as T_p."""
        self._prefill(ids[:16])

    def run(self, ids: list[int], decode_tokens: int) -> tuple[torch.Tensor, float]:
        """Selection counts [L, H, n] over `decode_tokens` decode steps, and the prefill's seconds."""
        self.counter.reset(len(ids))
        self._prefill_seconds.clear()
        self.pipeline.generate([ids], decode_tokens + 1)  # the first token comes from prefill
        return self.counter.counts, self._prefill_seconds[-1]

    def close(self) -> None:
        self.pipeline.close()


def profile(
    model: PreTrainedModel,
    tokenizer: Any,
    prompts: CalibrationSet | Sequence[str] | Sequence[Sequence[int]],
    selector: str | Selector,
    selector_params: dict[str, Any] | None = None,
    *,
    num_blocks: int = DEFAULT_NUM_BLOCKS,
    length_ranges: Sequence[tuple[int, int]] = ((1024, 2048),),
    decode_tokens: int = 16,
    link: LinkSpec = LinkSpec("rate", 15.0),
    limit: int | None = None,
    model_name: str | None = None,
    on_progress: ProgressFn | None = None,
    weights_id: int | None = None,
) -> list[Profile]:
    """One Profile per length range that at least one prompt falls in (at most `limit` prompts per range).

    `selector` is a name (quest, infinigen, topk, hata) or a Selector instance (tests); text prompts are
    tokenized with `tokenizer`, token-id prompts are used as they are. `on_progress(done, total)`
    is called after each prompt. HATA's `selector_params["weights"]` are recorded by `weights_id`
    (their row in the store's hash_weights) as "store:<id>".
    """
    if decode_tokens < 1:
        raise ValueError("decode_tokens must be >= 1")
    if link.kind not in ("rate", "inproc") or link.gbps <= 0:
        raise ValueError(f"link must be rate:<gbps> or inproc:<gbps> with a positive rate, got {link.label}")
    kind = selector_kind(selector)
    if not kind.sparse:
        raise ValueError("the dense selector picks every token: profile a sparse one (quest, infinigen, topk)")
    calibration = prompts if isinstance(prompts, CalibrationSet) else _inline_set(prompts)
    chosen = _assign(tokenize_calibration(tokenizer, calibration), length_ranges, limit)
    params = dict(selector_params or {})
    stored_params = _json_params({k: v for k, v in params.items() if k not in ("skew", "weights")})
    if kind.needs_training:  # learned tensors are named, never stored in the parameters
        stored_params["weights"] = f"store:{weights_id}" if weights_id is not None else "given"
    if kind.needs_warmup:
        stored_params["skew"] = "given" if "skew" in params else "calibration[0]"
        if "skew" not in params:
            from smartgen.runtime.prefill import infinigen_skewing

            params["skew"] = infinigen_skewing(model, chosen[0][0])  # InfiniGen's offline warm-up prompt

    num_layers = model.config.num_hidden_layers
    accumulators = [ImportanceAccumulator(num_layers, num_blocks) for _ in length_ranges]
    lengths: list[list[int]] = [[] for _ in length_ranges]
    seconds: list[list[float]] = [[] for _ in length_ranges]
    calibrator = _Calibrator(
        model, selector, params, num_blocks, max(len(ids) for ids, _ in chosen) + decode_tokens + 2
    )
    try:
        calibrator.warm_up(chosen[0][0])
        for done, (ids, feeds) in enumerate(chosen, start=1):
            counts, prefill_seconds = calibrator.run(ids, decode_tokens)
            for r in feeds:
                accumulators[r].add(counts)
                lengths[r].append(len(ids))
                seconds[r].append(prefill_seconds)
            if on_progress is not None:
                on_progress(done, len(chosen))
    finally:
        calibrator.close()

    layout = kv_layout(model, num_blocks=num_blocks)
    common = dict(
        model_fingerprint=model_fingerprint(model),
        selector=calibrator.counter.name,
        selector_params=stored_params,
        model=str(model_name or getattr(model.config, "_name_or_path", "") or model.config.model_type),
        calibration=calibration.name,
        calibration_hash=calibration.sha256,
        decode_tokens=decode_tokens,
        kv_bytes_per_token=layout.kv_bytes(1),
        link=link.label,
    )
    profiles = []
    for r, (lo, hi) in enumerate(length_ranges):
        if not lengths[r]:
            continue
        mean_length = statistics.fmean(lengths[r])
        if link.kind == "rate":
            transfer = transfer_seconds(layout.kv_bytes(1) * mean_length, link.gbps)
        else:
            transfer = measure_transfer(layout, round(mean_length), link.gbps)
        profiles.append(
            Profile(
                length_lo=lo,
                length_hi=hi,
                num_prompts=len(lengths[r]),
                mean_length=mean_length,
                prefill_seconds=statistics.fmean(seconds[r]),
                transfer_seconds=transfer,
                importance=accumulators[r].importance(),
                **common,
            )
        )
    return profiles


def downsample_blocks(importance: torch.Tensor, width: int) -> torch.Tensor:
    """[L, M] -> [L, min(M, width)]: each column the mean of the blocks it covers (for a terminal heat map)."""
    num_layers, num_blocks = importance.shape
    columns = max(1, min(num_blocks, width))
    target = torch.arange(num_blocks) * columns // num_blocks  # [M] -> column
    sums = torch.zeros(num_layers, columns, dtype=torch.float64).index_add_(1, target, importance.double())
    return (sums / torch.bincount(target, minlength=columns).double()).float()


def write_heatmap_png(profile: Profile, path: str | Path) -> None:
    """The importance matrix as a figure (layers × relative blocks), like the SmartGen paper's positional plot.

    Needs matplotlib (the `plot` extra); raises ImportError with the install hint without it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--png needs matplotlib: pip install 'smartgen[plot]' (or pip install matplotlib)") from None
    figure, axes = plt.subplots(figsize=(10, 0.35 * profile.num_layers + 1.6))
    image = axes.imshow(
        profile.importance.numpy(), aspect="auto", interpolation="nearest", cmap="viridis", origin="lower"
    )
    axes.set_xlabel(f"relative KV block (M = {profile.num_blocks})")
    axes.set_ylabel("layer")
    axes.set_title(
        f"{Path(profile.model).name or profile.model} · {profile.selector} · prompts {profile.length_range} tokens · "
        f"{profile.num_prompts} prompts of {profile.calibration}",
        fontsize=9,
    )
    figure.colorbar(image, ax=axes, label="importance (mean selections per entry)")
    figure.tight_layout()
    figure.savefig(path, dpi=150)
    plt.close(figure)
