"""Runs requests through a prefill engine and a decode engine joined by an in-process link.

The KV cache and the selector trace are synthetic and compute is emulated by sleeping
(`prefill_seconds_per_token`, `decode_layer_seconds`); everything else — the request driver
and prefill worker every entry point uses, plans, masks, pushes, fetches, speculation, pacing —
is the real thing. Used by the tests (which
check every assembled KV against the ground truth), the benchmarks and `smartgen simulate`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from smartgen.apps.regime import link_for
from smartgen.apps.synthetic import SyntheticTrace, synthetic_kv, synthetic_new_token
from smartgen.engine.decode import DecodeEngine
from smartgen.engine.kv_quant import SERVING_QUANT, quantize_kv
from smartgen.engine.layout import KVLayout
from smartgen.engine.planning import ImportanceAccumulator, Planner
from smartgen.engine.policy import Policy
from smartgen.engine.prefill import PrefillEngine
from smartgen.lanes.backends import loopback_link
from smartgen.lanes.rate import transfer_seconds
from smartgen.runtime.decode import DecodeBatch
from smartgen.runtime.driver import DecodeDriver, DriverRequest, Finished
from smartgen.runtime.prefill_worker import PrefillWorker

__all__ = ["SimulationConfig", "SimulationResult", "calibrate", "simulate", "compare", "link_rate_for"]


@dataclass(frozen=True, slots=True)
class SimulationConfig:
    """What to run: model shape, requests, link, emulated compute."""

    layout: KVLayout
    lengths: tuple[int, ...] = (2048,)
    steps: int = 16  # output tokens per request, the first one from prefill
    select_ratio: float = 0.1
    gbps: float | None = None  # None = unpaced
    delay_s: float = 0.0
    prefill_seconds_per_token: float = 0.0  # emulated prefill compute (all layers)
    decode_layer_seconds: float = 0.0  # emulated attention+FFN compute per layer per step
    seed: int = 0
    verify: bool = True  # compare every assembled KV with the ground truth
    calibration_prompts: int = 4
    calibration_steps: int = 4
    drain_speculation: bool = True  # after the last step, stay idle until speculation is done
    transport: str = (
        "inproc"  # a lane by name: "inproc" (queues and threads), or tcp, mooncake, nixl, rdma over 127.0.0.1
    )
    staged: bool = False  # the decode pool lands in host mirrors, copied into K and V before masks are read


@dataclass(slots=True)
class SimulationResult:
    """What one policy did: per-request timings and the bytes each path moved."""

    policy: str
    requests: list[dict[str, Any]]
    path_bytes: dict[str, int]
    push_descriptors: int
    on_demand_ratio: float
    max_fetch_count: int
    prefill_requests_left: int
    pool_equals_prefill: bool | None
    all_local: bool
    mismatches: int
    extra: dict[str, Any] = field(default_factory=dict)

    def mean(self, key: str) -> float | None:
        values = [r[key] for r in self.requests if r.get(key) is not None]
        return sum(values) / len(values) if values else None


def calibrate(config: SimulationConfig, trace: SyntheticTrace) -> torch.Tensor:
    """A profile: block importance [L, M] from calibration prompts (other seeds than the requests)."""
    accumulator = ImportanceAccumulator(config.layout.num_layers, config.layout.num_blocks)
    for i in range(config.calibration_prompts):
        length = config.lengths[i % len(config.lengths)]
        accumulator.add(trace.request_counts(length, config.calibration_steps, seed=10_000 + i))
    return accumulator.importance()


class _SyntheticPrefill:
    """The prefill runner's part with emulated compute: each layer's synthetic K/V after its share of the time.

    A synthetic prompt's tokens name its request (all equal to the request's index), so the
    one prefill worker (`runtime.prefill_worker`) can run it like a model's prompt.
    """

    selector_reads_queries = False

    def __init__(self, config: SimulationConfig, kvs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.layer_seconds = config.prefill_seconds_per_token / config.layout.num_layers
        self.num_layers = config.layout.num_layers
        self.kvs = kvs

    def run(
        self,
        prompt: torch.Tensor,
        on_layer: Callable[..., object],
        *,
        last_query_scores: bool = False,
        prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SimpleNamespace:
        """`last_query_scores` is accepted and ignored: a synthetic prompt has no queries (no "query" pick);
        `prefix` never comes (the simulation's prefill engine has no prefix cache)."""
        k, v = self.kvs[int(prompt[0])]
        for layer in range(self.num_layers):
            if self.layer_seconds:
                time.sleep(self.layer_seconds * prompt.numel())
            on_layer(layer, k[layer], v[layer], {})
        return SimpleNamespace(first_token=0)


class _SyntheticDecode:
    """The decode runner's part with emulated compute: per layer, the idle notice, the selector's index from the
    trace, `assemble` (checked against the ground truth), the emulated layer time, the new token's true K/V.
    `bench/context_cost.py` times the engine's share of each step through this runner."""

    def __init__(
        self,
        engine: DecodeEngine,
        config: SimulationConfig,
        trace: SyntheticTrace,
        truths: list[tuple[torch.Tensor, torch.Tensor]],
        index_of: dict[str, int],
    ) -> None:
        self.engine = engine
        self.config = config
        self.trace = trace
        self.truths = truths
        self.index_of = index_of
        self.mismatches = 0

    def step(self, batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
        config, layout = self.config, self.config.layout
        requests = [self.index_of[rid] for rid in batch.request_ids]
        steps = [int(p) - n + 1 for p, n in zip(batch.positions.tolist(), batch.prompt_lengths)]
        truths = [self.truths[i] for i in requests]
        for layer in range(layout.num_layers):
            self.engine.begin_layer(layer, batch.request_ids)
            # the questions the runtime asks every layer (runtime/decode.py: hints' width, whether the next layer
            # prefetches): the answers are not acted on here (the trace has no wider ranking nor speculated query),
            # but asking them costs the decode node what it costs in serving
            self.engine.hint_factor(batch.request_ids, layer)
            index = _step_index(self.trace, config, requests, steps, layer)
            assembled = self.engine.assemble(layer, batch.request_ids, index)
            if config.verify:
                self.mismatches += _count_mismatches(assembled, truths, layer)
            if layer + 1 < layout.num_layers:
                self.engine.prefetch_wanted(batch.request_ids, layer + 1)
            if config.decode_layer_seconds:
                time.sleep(config.decode_layer_seconds)
            for b, rid in enumerate(batch.request_ids):
                at = batch.prompt_lengths[b] + steps[b] - 1
                self.engine.append(layer, rid, truths[b][0][layer, at], truths[b][1][layer, at])
        num = len(batch.request_ids)
        return torch.zeros(num, dtype=torch.int64), torch.zeros(num, 1)


def simulate(
    config: SimulationConfig,
    policy: Policy | Sequence[Policy],
    importance: torch.Tensor | None = None,
    on_step: Callable[[int], None] | None = None,
) -> SimulationResult:
    """Runs one batch of requests (one per entry of `config.lengths`) under `policy`, or one policy per request."""
    layout = config.layout
    policies = [policy] * len(config.lengths) if isinstance(policy, Policy) else list(policy)
    if len(policies) != len(config.lengths):
        raise ValueError(f"{len(policies)} policies for {len(config.lengths)} requests")
    trace = SyntheticTrace(layout.num_layers, layout.num_kv_heads, ratio=config.select_ratio)
    planner = Planner(
        layout.num_layers,
        layout.num_blocks,
        importance,
        prefill_seconds_per_token=config.prefill_seconds_per_token,
        transfer_seconds_per_token=_transfer_seconds_per_token(config),
        seed=config.seed,
    )
    prefill = PrefillEngine(layout, planner)
    decode = DecodeEngine(
        layout, num_slots=len(config.lengths), max_tokens=max(config.lengths) + config.steps + 1, staged=config.staged
    )
    if config.verify:
        decode.pool.k.fill_(float("nan"))  # a read of anything not yet landed shows up as a mismatch
        decode.pool.v.fill_(float("nan"))
    prefill_end, decode_end = loopback_link(config.transport, config.gbps, config.delay_s)
    prefill.attach(prefill_end, decode.pool.geometry)
    decode.attach(decode_end)

    request_ids = [f"req-{config.seed}-{i}" for i in range(len(config.lengths))]
    kvs = {
        rid: synthetic_kv(layout, n, seed=config.seed * 101 + i)
        for i, (rid, n) in enumerate(zip(request_ids, config.lengths))
    }
    for i, (rid, n) in enumerate(zip(request_ids, config.lengths)):
        if policies[i].strategy == "optimal":
            prefill.oracle_counts[rid] = trace.request_counts(n, config.steps, seed=config.seed * 101 + i)
    # what each request's pool must hold once its prompt landed: the prompt's KV, or what a quantized transfer
    # of it delivers (lossy by design)
    landed = {rid: _as_landed(kvs[rid], p) for rid, p in zip(request_ids, policies)}
    # The ground truth (prompt + generated KV) is made up front, so the timed loop runs only the engine.
    truths = [_truth(config, i, landed[rid]) for i, rid in enumerate(request_ids)]
    synthetic = _SyntheticDecode(decode, config, trace, truths, {rid: i for i, rid in enumerate(request_ids)})
    driver = DecodeDriver(synthetic, prefill_timeout=600)  # type: ignore[arg-type]  # a runner without a model
    worker = PrefillWorker(prefill, _SyntheticPrefill(config, [kvs[rid] for rid in request_ids]))  # type: ignore[arg-type]
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop, 0.02), name="prefill", daemon=True)
    thread.start()
    try:
        for i, (rid, n, request_policy) in enumerate(zip(request_ids, config.lengths, policies)):
            # steps + 1 tokens: the driver never finishes them; the checks below need their KV in place
            request = DriverRequest(rid, torch.full((n,), i, dtype=torch.int64), request_policy, config.steps + 1)
            _raise_failed(driver.add(request))
        while driver.prefilling:  # every request joins before the first step, as in the pipeline
            _raise_failed(driver.collect_first_tokens())
            time.sleep(0.0002)
        for step in range(1, config.steps):
            _raise_failed(driver.step())
            if on_step:
                on_step(step)
        if config.drain_speculation:
            _drain(decode, [rid for rid, p in zip(request_ids, policies) if p.speculative])
        all_local = all(
            decode.pool.masks.all_local(decode.slot_of(rid), n) for rid, n in zip(request_ids, config.lengths)
        )
        pool_equal = None
        if config.verify and all_local:
            pool_equal = all(
                torch.equal(decode.pool.k[:, decode.slot_of(rid), :n], landed[rid][0])
                and torch.equal(decode.pool.v[:, decode.slot_of(rid), :n], landed[rid][1])
                for rid, n in zip(request_ids, config.lengths)
            )
        max_fetch = max(int(decode.fetch_counts(rid).max()) for rid in request_ids)
        metrics = [decode.finish(rid) for rid in request_ids]
        _wait(lambda: prefill.store.num_requests == 0, 10)
        push = prefill_end.push.counters.snapshot()
        path_bytes = {path: prefill.counters.bytes.get(path, 0) for path in ("proactive", "speculative", "on_demand")}
        path_bytes["proactive"] += prefill.counters.bytes.get("full", 0)  # a full transfer's pushes, for the table
        return SimulationResult(
            policy=" | ".join(dict.fromkeys(p.label for p in policies)),
            requests=[m.snapshot() for m in metrics],
            path_bytes=path_bytes,
            push_descriptors=push["num_descriptors"],
            on_demand_ratio=decode.counters.on_demand_ratio,
            max_fetch_count=max_fetch,
            prefill_requests_left=prefill.store.num_requests,
            pool_equals_prefill=pool_equal,
            all_local=all_local,
            mismatches=synthetic.mismatches,
        )
    finally:
        stop.set()
        decode.close()
        prefill.close()
        thread.join(timeout=5)


def _raise_failed(events: list) -> None:
    for event in events:
        if isinstance(event, Finished) and event.failed:
            raise RuntimeError(f"simulated request {event.request_id} failed: {event.error}")


def _transfer_seconds_per_token(config: SimulationConfig) -> float:
    if config.gbps is None:
        return 0.0
    return transfer_seconds(config.layout.kv_bytes(1), config.gbps)


def _wait(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def _step_index(
    trace: SyntheticTrace, config: SimulationConfig, requests: list[int], steps: list[int], layer: int
) -> torch.Tensor:
    """The selector's index [B·H, k] for one layer: request `requests[b]` at its step `steps[b]`; -1 pads."""
    heads = config.layout.num_kv_heads
    rows = [
        trace.select(layer, n, n + step - 1, seed=(config.seed * 101 + i) * 7919 + step * 131 + layer)
        for i, step in zip(requests, steps)
        for n in (config.lengths[i],)
    ]
    index = torch.full((len(rows) * heads, max(r.shape[1] for r in rows)), -1, dtype=torch.int64)
    for b, r in enumerate(rows):
        index[b * heads : (b + 1) * heads, : r.shape[1]] = r
    return index


def _drain(decode: DecodeEngine, request_ids: list[str], timeout: float = 120.0) -> None:
    """Keeps telling the prefill nodes the link is idle until speculation has moved everything."""
    deadline = time.monotonic() + timeout
    pending = [rid for rid in request_ids if not decode.is_released(rid)]
    while pending and time.monotonic() < deadline:
        decode.begin_layer(0, pending)
        time.sleep(0.001)
        decode.release_fully_local(pending)
        pending = [rid for rid in pending if not decode.is_released(rid)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so NaN poisoning and -0.0 compare exactly."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _as_landed(prompt_kv: tuple[torch.Tensor, torch.Tensor], policy: Policy) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [L, n, H, d] as the decode pool ends up holding them under `policy`."""
    if not policy.quantize_bits:
        return prompt_kv
    pairs = [quantize_kv(k, v, SERVING_QUANT) for k, v in zip(*prompt_kv)]
    return torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])


def _truth(
    config: SimulationConfig, request: int, prompt_kv: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [L, n + steps, H, d] of one request: the prompt, then every generated token."""
    layout = config.layout
    new = [
        [synthetic_new_token(layout, config.seed * 101 + request, step, layer) for layer in range(layout.num_layers)]
        for step in range(1, config.steps)
    ]
    k_new = (
        torch.stack([torch.stack([kv[0] for kv in per_step]) for per_step in new], dim=1)
        if new
        else prompt_kv[0][:, :0]
    )
    v_new = (
        torch.stack([torch.stack([kv[1] for kv in per_step]) for per_step in new], dim=1)
        if new
        else prompt_kv[1][:, :0]
    )
    return torch.cat([prompt_kv[0], k_new], dim=1), torch.cat([prompt_kv[1], v_new], dim=1)


def _count_mismatches(assembled, truths: list[tuple[torch.Tensor, torch.Tensor]], layer: int) -> int:
    """Selected entries whose assembled K or V differs (bitwise) from the ground truth."""
    heads = truths[0][0].shape[2]
    rows, k = assembled.split.index.shape
    row_ids = torch.arange(rows)
    valid = torch.arange(k).unsqueeze(0) < assembled.num_valid.unsqueeze(1).long()  # [R, k]
    bad = 0
    for i, (k_true, v_true) in enumerate(truths):
        rs = row_ids[i * heads : (i + 1) * heads]
        pos = assembled.split.index[rs].clamp(min=0)  # [H, k]; padding is masked out below
        head = (rs % heads).unsqueeze(1).expand_as(pos)
        expect_k, expect_v = k_true[layer, pos, head], v_true[layer, pos, head]  # [H, k, d]
        same = (_bits(assembled.k[rs]) == _bits(expect_k)).all(-1) & (_bits(assembled.v[rs]) == _bits(expect_v)).all(-1)
        bad += int((~same & valid[rs]).sum())
    return bad


def link_rate_for(config: SimulationConfig, transfer_ratio: float) -> float:
    """The Gbit/s at which a full transfer of the batch takes `transfer_ratio` × its prefill time."""
    prefill_seconds = config.prefill_seconds_per_token * max(config.lengths)
    total_bytes = sum(config.layout.kv_bytes(n) for n in config.lengths)
    return link_for(total_bytes, prefill_seconds, stall_ratio=transfer_ratio).link_gbps


def compare(
    config: SimulationConfig,
    policies: list[Policy],
    on_progress: Callable[[str, int], None] | None = None,
) -> list[SimulationResult]:
    """Calibrates a profile once, then runs every policy on the same requests; results in order."""
    trace = SyntheticTrace(config.layout.num_layers, config.layout.num_kv_heads, ratio=config.select_ratio)
    importance = calibrate(config, trace)
    results = []
    for policy in policies:
        step_cb = (lambda step, name=policy.label: on_progress(name, step)) if on_progress else None
        results.append(simulate(config, policy, importance, on_step=step_cb))
    return results
