"""Runs a benchmark: a pilot to measure the regime, then every point's schemes, interleaved, on real nodes.

1. The model's profile is made once if the store has none (as the demo does).
2. Pilot: unpaced nodes serve a warm-up and PILOT_RUNS full-transfer requests per prompt length,
   which measure the prefill time as served (TTFT) and the all-local step time (TBT); and per --batch above 1,
   that many concurrent requests, long enough to decode together: the all-local step of that batch
   (local_step.py), what no scheme's requests beat while they share a step.
3. Per group of points sharing node settings: the link rate follows the stall ratio (a full
   transfer of one request takes R x its prefill) or is given in Gbit/s; with a decode-side ratio,
   each decode layer gets emulated compute so that an all-local step's link budget is that share
   of the selected bytes of a step. Then nodes start with those settings.
4. Per point: `warmup + reps` rounds, each running every scheme once (A B C A B C ...), a batch of
   concurrent requests each, streamed and timed as a client sees them (client.py) beside the node's own usage;
   the warm-up rounds are kept in the results but left out of the stats. Each round's joins (joins.py) go with it.
5. A prefix-hit sweep (`prefix_hit`) starts the nodes with their prefix caches on; each point's
   prompts share their first share of tokens (cached by one warm-up request) and continue with
   tokens of their own, so every request hits exactly that prefix and nothing more.
6. Load mode (`load_rate`) replaces the rounds with Poisson arrivals per rate and scheme on the group's nodes
   (load.py); trace mode (`trace`) replays a trace slice per rate and scheme on fresh nodes (trace_run.py).

Steps 1, 2 and 3-5 are the phases `progress` sees and results.json records ("model", "pilot", "rounds").
"""

from __future__ import annotations

import os
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from smartgen.apps.bench.client import Streamed, stream_completion
from smartgen.apps.bench.config import BenchConfig, Point, lane_words
from smartgen.apps.bench.joins import find_joins
from smartgen.apps.bench.load import run_load
from smartgen.apps.bench.local_step import MAX_TOKENS, batch_step, pilot_tokens
from smartgen.apps.bench.models import resolve_model
from smartgen.apps.bench.phases import Phases, ProgressFn
from smartgen.apps.bench.results import BenchResult, Group, Regime
from smartgen.apps.bench.watch import NodeWatch, num_links, read_link
from smartgen.apps.cluster import ClusterSpec, LocalCluster, node_cpus
from smartgen.apps.regime import decode_side, emulate_flags, emulation_words, link_for, step_selected_bytes
from smartgen.engine.metrics import FETCH_KINDS, STEP_FIELDS
from smartgen.lanes.link_timeline import between

__all__ = ["BenchResult", "Group", "Regime", "run_bench"]

PILOT_TOKENS = 8
PILOT_RUNS = 3
PREFIX_BLOCK_TOKENS = 16  # `serve --prefix-block-tokens`' default, which the benchmark's nodes run with
PREFIX_CACHE_BYTES = "8G"  # per node in a prefix sweep: far more than a run's prompts, so nothing is evicted
TRACE_PROFILE_LENGTH = 1024  # a profile of 512-2048 tokens: the calibration prompts have 985-2049
TRANSFER_PATHS = ("full", "proactive", "on_demand", "speculative", "metadata")  # "full": full transfer's pushes


def _machine() -> dict[str, Any]:
    from smartgen.sysinfo import collect_info

    info = collect_info()
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "versions": info["versions"],
        "cuda": info["cuda"].get("status"),
    }


def run_bench(
    config: BenchConfig,
    say: Callable[[str], None] = print,
    progress: ProgressFn | None = None,
) -> BenchResult:
    """Runs every point of `config`; `progress(what, done, total)` opens each phase (loading and profiling the
    model: no total; the pilot: its requests; the rounds: one step per request group) and reports every step."""
    from smartgen.apps.evalsuite import MAX_NEW_TOKENS
    from smartgen.apps.stored_profile import ensure_profile
    from smartgen.runtime.models import kv_layout

    if config.routers and config.router_python is None:  # before any node starts: RouterUnavailable says why not
        from smartgen.apps.router import ensure_router

        config = replace(config, router_python=ensure_router(say=say))
    phases = Phases(progress)
    # no count here: ensure_profile does not report its calibration prompts, so the bar says what runs instead
    phases.start("model", None, "loading the model (first run: profiling it)")

    def say_too(line: str) -> None:
        say(line)
        phases.say(line)

    model_path, trained = resolve_model(config.model, config.seed)
    tokenizer = None
    layout = None
    # a trace's median prompt may be shorter than any calibration prompt; the nodes plan with the nearest profile
    length = config.lengths[0] if config.trace is None else max(config.lengths[0], TRACE_PROFILE_LENGTH)
    for blocks in sorted(set(config.blocks)):
        _, model, tokenizer = ensure_profile(
            model_path, config.db, config.selector, config.budget[0], blocks, length, say=say_too
        )
        layout = kv_layout(model, num_blocks=blocks)
        del model
    assert tokenizer is not None and layout is not None
    points = config.points()
    result = BenchResult(config, str(model_path), trained, points, [], machine=_machine())
    if not trained:
        result.notes.append("random weights: timings only, accuracy not reported")
    elif not config.loaded and (short := [t for t in config.tasks if MAX_NEW_TOKENS[t] > config.output_tokens]):
        result.notes.append(
            f"--output-tokens {config.output_tokens} is shorter than the answers of {', '.join(short)} "
            f"({', '.join(str(MAX_NEW_TOKENS[t]) for t in short)} tokens): their scores read a cut answer"
        )
    prompts = _Prompts(config, tokenizer)
    say(f"pilot: prefill and all-local step time of {model_path.name} as served, unpaced")
    batches = _pilot_batches(config)
    steps = len(set(config.lengths)) * (PILOT_RUNS + 1 + len(batches))
    phases.start("pilot", steps, "pilot: starting unpaced nodes")
    pilot, batch_steps = _pilot(config, model_path, prompts, phases, batches, say_too)
    trace = config.trace.read() if config.trace is not None else None
    rates = len(config.load_rate) if config.loaded else 1
    rounds = 1 if config.loaded else config.warmup + config.reps
    phases.start("rounds", len(points) * rates * rounds * len(config.all_schemes), "starting the paced nodes")
    by_nodes: dict[tuple, list[int]] = {}
    for i, point in enumerate(points):
        by_nodes.setdefault(point.node_key(), []).append(i)
    regimes: dict[int, Regime] = {}
    for indices in by_nodes.values():
        first = points[indices[0]]
        regime = _regime(config, first, pilot, layout.kv_bytes(1), layout.num_layers)
        regime.batch_step_s = batch_steps
        say(
            f"nodes over the {lane_words(config.lane)}: link {regime.link_gbps * 1e3:.1f} Mbit/s (full transfer {regime.stall_ratio:.2f}x prefill at "
            f"{regime.reference_length} tokens), decode-side ratio {regime.decode_ratio:.3f}"
            + emulation_words(regime.emulate_layer_ms, regime.emulate_floor_ms)
            + f", CPUs {regime.cpus}"
        )
        spec = _spec(config, model_path, first, regime)
        if trace is not None:  # fresh nodes per rate and scheme (trace_run.py), not one set for the group
            from smartgen.apps.bench.trace import single_token_words
            from smartgen.apps.bench.trace_run import run_trace_point

            vocab = min(len(tokenizer), 32000)
            words = single_token_words(tokenizer) if config.routers else None  # the router takes text prompts only
            for i in indices:
                regimes[i] = regime
                runs = run_trace_point(config, i, points[i], spec, regime, trace, vocab, _request, phases, say, words)
                result.loads.extend(runs)
            continue
        phases.say(f"starting nodes ({first.label(config.link_mode)})")
        with LocalCluster(spec) as cluster:
            regime.link = read_link(cluster.url)
            for i in indices:
                regimes[i] = regime
                point = points[i]
                if config.load_rate:
                    _request(cluster.url, prompts.sample(config.tasks[0], point.length, config.seed).prompt, "full", 4)
                    for rate in config.load_rate:
                        load = config.load_spec(rate)
                        for scheme in config.all_schemes:
                            result.loads.append(_run_load(cluster, config, i, point, scheme, prompts, load, regime))
                            phases.step(f"{scheme} under load at {rate:g} req/s ({point.label(config.link_mode)})")
                    continue
                if point.prefix_hit:
                    warm = prompts.prefixed(point, rep=-1, salt=0)[0].prompt  # puts the shared prefix in the caches
                    _request(cluster.url, warm, "full", 4)
                for rep in range(config.warmup + config.reps):
                    batch_prompts = prompts.batch(point, rep)
                    recorded: list[Any] | None = None  # full transfer's selection counts, per prompt of the round
                    for s, scheme in enumerate(config.all_schemes):
                        samples = batch_prompts if point.prefix_hit is None else prompts.prefixed(point, rep, s)
                        # a prefix point's prompts are cut and spliced: their answers are not the task's
                        scored = trained and point.prefix_hit is None
                        # the optimal set replays what full transfer's run of the same prompts selected (greedy
                        # decoding over exact KV selects the same entries under every exact scheme)
                        record = scheme == "full" and config.needs_oracle
                        oracles = recorded if _is_optimal(scheme) else None
                        group, counts = _run_group(
                            cluster, config, i, point, scheme, rep, samples, prompts, scored, record, oracles
                        )
                        if record:
                            recorded = counts
                        result.groups.append(group)
                        phases.step(f"{scheme} ({point.label(config.link_mode)})")
    phases.end()
    result.regimes = [regimes[i] for i in range(len(points))]
    if trace is not None:
        result.trace = trace.to_json()
    result.phases = phases.to_json()
    return result


@dataclass(frozen=True, slots=True)
class PrefixedPrompt:
    """A prompt of a prefix-hit point, as token ids: `cached` leading tokens shared with the warm-up request."""

    task: str
    prompt: list[int]
    cached: int


class _Prompts:
    """Eval-suite prompts (passkey, needles): the same prompts for every scheme of a round."""

    def __init__(self, config: BenchConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._cache: dict[tuple[str, int, int], Any] = {}

    def sample(self, task: str, length: int, seed: int) -> Any:
        from smartgen.apps.evalsuite import generate_task

        key = (task, length, seed)
        if key not in self._cache:
            self._cache[key] = generate_task(task, length, seed, self.tokenizer, "eval")
        return self._cache[key]

    def batch(self, point: Point, rep: int) -> list[Any]:
        tasks = self.config.tasks
        base = self.config.seed + rep * point.batch
        return [self.sample(tasks[(base + i) % len(tasks)], point.length, base + i) for i in range(point.batch)]

    def prefixed(self, point: Point, rep: int, salt: int) -> list[Any]:
        """A prefix point's batch: the first `prefix_hit` of each prompt (whole cache blocks) is a base prompt's,
        the rest seeded random tokens of this (round, scheme, request) alone, so nothing else can hit."""
        import torch

        base = self.tokenizer.encode(self.sample(self.config.tasks[0], point.length, self.config.seed).prompt)
        length = len(base)
        cached = int((point.prefix_hit or 0.0) * length) // PREFIX_BLOCK_TOKENS * PREFIX_BLOCK_TOKENS
        vocab = min(len(self.tokenizer), 32000)
        batch = []
        for i in range(point.batch):
            seed = self.config.seed * 7919 + (rep + 2) * 104729 + salt * 1009 + i
            tail = torch.randint(3, vocab, (length - cached,), generator=torch.Generator().manual_seed(seed))
            batch.append(PrefixedPrompt(f"prefix {point.prefix_hit:.0%}", base[:cached] + tail.tolist(), cached))
        return batch

    def score(self, sample: Any, text: str) -> float:
        from smartgen.apps.evalsuite import score_sample

        # the answer is the first few tokens; the rest of a fixed-length timing run is not part of it
        ids = self.tokenizer.encode(text, add_special_tokens=False)[: sample.max_new_tokens]
        return score_sample(sample, self.tokenizer.decode(ids))


def _pilot_batches(config: BenchConfig) -> list[int]:
    """The batch sizes whose all-local step the pilot measures besides batch 1: the rounds' concurrent batches
    (load and trace modes have no fixed batch)."""
    if config.loaded or config.trace is not None:
        return []
    return sorted(b for b in set(config.batch) if b > 1)


def _pilot(
    config: BenchConfig,
    model_path: Path,
    prompts: _Prompts,
    phases: Phases,
    batches: list[int],
    say: Callable[[str], None],
) -> tuple[dict[int, tuple[float, float]], dict[int, dict[int, float]]]:
    """Prompt length -> (prefill s, all-local step s), measured on unpaced nodes by the decode node's own clock (the
    regime is the nodes'): the least of PILOT_RUNS requests after a warm-up one, since on a shared machine other work
    only ever adds time. And prompt length -> batch -> the all-local step with that many requests decoding together
    (local_step.py, the client's clock), for each of `batches`. One phase step per request, or per batch."""
    lengths = sorted(set(config.lengths))
    spec = ClusterSpec(
        model=model_path,
        lane=config.lane,
        lane_flags=config.lane_flags,
        blocks=config.blocks[0],
        selector=config.selector,
        budget=config.budget[0],
        max_batch=max([1, *batches]),
        # a batch-step request asks for up to MAX_TOKENS (pilot_tokens); without batches, slots as the rounds' nodes
        max_tokens=max(config.lengths) + (MAX_TOKENS if batches else config.output_tokens) + 64,
        db=config.db,
        separate_cpus=config.separate_cpus,
        device=config.device,
    )
    measured: dict[int, tuple[float, float]] = {}
    batch_steps: dict[int, dict[int, float]] = {}
    with LocalCluster(spec) as cluster:
        for length in lengths:
            sample = prompts.sample(config.tasks[0], length, config.seed)
            runs = []
            for _ in range(PILOT_RUNS + 1):
                runs.append(_request(cluster.url, sample.prompt, "full", PILOT_TOKENS).usage)
                phases.step(f"pilot: {length} tokens")
            measured[length] = (min(float(u["ttft"]) for u in runs[1:]), min(float(u["tbt"]) for u in runs[1:]))
            for batch in batches:
                step = _batch_step(cluster.url, prompts, config, length, batch, *measured[length], say)
                if step is not None:
                    batch_steps.setdefault(length, {})[batch] = step
                else:
                    say(f"pilot: {batch} requests of {length} tokens did not decode together long enough to time")
                phases.step(f"pilot: {length} tokens, batch {batch}")
    return measured, batch_steps


def _batch_step(
    url: str,
    prompts: _Prompts,
    config: BenchConfig,
    length: int,
    batch: int,
    prefill_s: float,
    step_s: float,
    say: Callable[[str], None],
) -> float | None:
    """The all-local step of `batch` full-transfer requests decoding together (local_step.batch_step); None when
    they did not overlap long enough. Each request its own prompt, so no prefix cache serves one from another."""
    tokens = pilot_tokens(batch, prefill_s, step_s)
    samples = [prompts.sample(config.tasks[0], length, config.seed + 1 + b) for b in range(batch)]
    streams: list[Streamed | None] = [None] * batch

    def one(b: int) -> None:
        try:
            streams[b] = _request(url, samples[b].prompt, "full", tokens)
        except Exception as error:  # the pilot goes on without this figure: the tables then show none
            say(f"pilot: batch {batch} at {length} tokens: {error}")

    threads = [threading.Thread(target=one, args=(b,), daemon=True) for b in range(batch)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if any(s is None for s in streams):
        return None
    return batch_step([(s.sent, s.arrivals) for s in streams if s is not None])


def _regime(config: BenchConfig, point: Point, pilot: dict[int, tuple[float, float]], token_bytes: int, layers: int):
    from smartgen.lanes.rate import bytes_per_second

    reference = point.length
    prefill_s, step_s = pilot[reference]
    kv = token_bytes * reference
    stall = config.link_mode == "stall"
    link = link_for(kv, prefill_s, stall_ratio=point.link if stall else None, gbps=None if stall else point.link)
    selected = step_selected_bytes(point.budget, reference, token_bytes, layers)
    side = decode_side(
        config.decode_ratio,
        selected,
        bytes_per_second(link.link_gbps),
        step_s,
        layers,
        floor=config.decode_emulation == "floor",
    )
    return Regime(
        link_gbps=link.link_gbps,
        stall_ratio=link.stall_ratio,
        reference_length=reference,
        prefill_s={n: p for n, (p, _) in pilot.items()},
        step_s={n: s for n, (_, s) in pilot.items()},
        emulate_layer_ms=side.emulate_layer_ms,
        decode_ratio=side.decode_ratio,
        kv_bytes_per_token=token_bytes,
        num_layers=layers,
        cpus=_cpu_words(config),
        emulate_floor_ms=side.emulate_floor_ms,
    )


def _cpu_words(config: BenchConfig) -> str:
    split = node_cpus(config.separate_cpus, config.lane)
    if split is None:
        return "shared"
    prefill, decode = (",".join(map(str, cpus)) for cpus in split)
    return f"prefill {prefill}, decode {decode}"


def _spec(config: BenchConfig, model_path: Path, point: Point, regime: Regime) -> ClusterSpec:
    extra = emulate_flags(regime.emulate_layer_ms, regime.emulate_floor_ms)
    if config.shared_link:  # one link into the decode node at the regime's rate, whatever sends over it
        extra = (*extra, "--ingress-gbps", f"{regime.link_gbps:.9f}")
    return ClusterSpec(
        model=model_path,
        link_gbps=regime.link_gbps,
        lane=config.lane,
        lane_flags=config.lane_flags,
        blocks=point.blocks,
        selector=config.selector,
        budget=point.budget,
        speculative_ratio=point.speculative_ratio,
        prefill_nodes=point.prefill_nodes,
        decode_nodes=config.decode_nodes,
        max_batch=config.node_batch,
        max_tokens=max(config.lengths) + config.output_tokens + 64,
        db=config.db,
        separate_cpus=config.separate_cpus,
        device=config.device,
        decode_extra=extra,
        # the prefill node's own decode steps (forecast, head start) pay the same emulated compute
        prefill_extra=emulate_flags(regime.emulate_layer_ms, regime.emulate_floor_ms),
        prefill_cache=PREFIX_CACHE_BYTES if config.prefix_hit and config.prefix_cache != "decode" else "0",
        decode_cache=PREFIX_CACHE_BYTES if config.prefix_hit and config.prefix_cache != "prefill" else "0",
    )


def _request(
    url: str, prompt: str | list[int], scheme: str, max_tokens: int, extra: dict[str, Any] | None = None
) -> Streamed:
    """One greedy completion of exactly `max_tokens` tokens, streamed (the node's token times in its usage)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "scheme": scheme}
    return stream_completion(url, {**body, **(extra or {})})


def _is_optimal(scheme: str) -> bool:
    from smartgen.engine.policy import split_label

    return split_label(scheme)[1] == "optimal"


def _totals(status: dict[str, Any]) -> dict[str, float]:
    """Sums over the prefill nodes: bytes per path, descriptors posted, time posting, bytes on the links; and the
    bytes the decode node sent back over its links (`link_bytes_back`), its fetch replies landed and their summed
    time from sending to the reply's arrival (`fetches`, `fetch_s`; by kind, `fetches.<kind>` and `fetch_s.<kind>`, and
    the decode steps' waits for replies of that kind, `fetch_wait_s.<kind>`), and its
    decode steps by batch size (`steps.<batch>.<part>`, metrics.STEP_FIELDS) and its threads' CPU seconds by role
    (`threads.<role>`, roles/thread_cpu.py; the prefill nodes' summed, `prefill_threads.<role>`)."""
    totals: dict[str, float] = {f"bytes.{p}": 0 for p in TRANSFER_PATHS}
    totals.update(descriptors=0, posting_s=0.0, link_bytes=0, link_bytes_back=0)
    paths = status["decode"].get("paths", {})
    totals["fetches"] = paths.get("transfers", {}).get("on_demand", 0)
    totals["fetch_s"] = paths.get("seconds", {}).get("on_demand", 0.0)
    for kind, landed in paths.get("fetches", {}).items():
        totals[f"fetches.{kind}"] = landed["landed"]
        totals[f"fetch_s.{kind}"] = landed["seconds"]
        totals[f"fetch_wait_s.{kind}"] = landed.get("waited", 0.0)
    for batch, parts in paths.get("steps", {}).items():
        for name in STEP_FIELDS:
            totals[f"steps.{batch}.{name}"] = parts[name]
    for role, seconds in status["decode"].get("threads_cpu", {}).items():
        totals[f"threads.{role}"] = seconds
    for link in status["decode"].get("links", []):
        totals["link_bytes_back"] += link["push"]["bytes_sent"] + link["control"]["bytes_sent"]
    for node in status["prefill"]:
        for role, seconds in node.get("threads_cpu", {}).items():
            totals[f"prefill_threads.{role}"] = totals.get(f"prefill_threads.{role}", 0.0) + seconds
        for path in TRANSFER_PATHS:
            totals[f"bytes.{path}"] += node["paths"]["bytes"].get(path, 0)
        for link in node["links"]:
            totals["descriptors"] += link["push"]["num_descriptors"]
            totals["posting_s"] += link["push"]["posting_seconds"]  # pacer waits excluded
            totals["link_bytes"] += link["push"]["bytes_sent"] + link["control"]["bytes_sent"]
    return totals


def _run_group(
    cluster: LocalCluster,
    config: BenchConfig,
    index: int,
    point: Point,
    scheme: str,
    rep: int,
    samples: list[Any],
    prompts: _Prompts,
    trained: bool,
    record: bool = False,
    oracles: list[Any] | None = None,
) -> tuple[Group, list[Any]]:
    """One round of one scheme; with `record`, also each request's usage.selection_counts (None where it failed),
    which `oracles` hands to the optimal strategy's requests of the same prompts."""
    before = _totals(cluster.status())
    answers: list[Streamed | None] = [None] * len(samples)
    errors: list[str | None] = [None] * len(samples)
    if _is_optimal(scheme) and oracles is None:
        oracles = [None] * len(samples)

    def one(i: int) -> None:
        extra: dict[str, Any] = {"return_selection_counts": True} if record else {}
        if oracles is not None:
            if oracles[i] is None:
                errors[i] = "no recorded selection to replay: this prompt's full-transfer run failed"
                return
            extra["proactive_counts"] = oracles[i]
        try:
            answers[i] = _request(cluster.url, samples[i].prompt, scheme, config.output_tokens, extra)
        except Exception as exc:  # a failed request is a result, not a crash of the benchmark
            errors[i] = str(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(samples))]
    started = time.perf_counter()  # the clock the client stamps with: each request's `sent` is from here
    link_from = time.monotonic()  # the pacers' clock (the nodes run on this machine)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    _settle(cluster)
    status = cluster.status()
    after = _totals(status)
    timelines = [node.get("link", {}).get("timeline") or {} for node in status["prefill"]]
    link_to = max([time.monotonic(), *(b[0] for t in timelines for b in t.get("bins", []))])
    requests = []
    for sample, answer, error in zip(samples, answers, errors):
        if answer is None:
            requests.append({"task": sample.task, "error": error})
            continue
        usage = answer.usage
        requests.append(
            {
                "task": sample.task,
                "prompt_tokens": usage["prompt_tokens"],
                "sent": answer.sent - started,
                **answer.timings(),  # the client's ttft, ttst, tbt, e2e, itl, ctl; the node's node_ttft, ...
                "selection_union_bytes": usage.get("selection_union_bytes") or [],
                # the decode node's timeline of the request: what a joiner waited for, and each token's link wait
                "milestones": usage.get("milestones") or {},
                "token_waits": usage.get("token_waits") or [],
                "on_demand_ratio": usage.get("on_demand_ratio"),
                "fetched_tokens": usage.get("fetched_tokens"),
                "completion_tokens": usage.get("completion_tokens"),
                "first_step_coverage": usage.get("first_step_coverage"),
                "first_step_wait": usage.get("first_step_wait"),
                "fetch_wait": usage.get("fetch_wait"),
                "prefetched_entries": usage.get("prefetched_entries"),
                "forecast_entries": usage.get("forecast_entries"),
                "deferred_steps": usage.get("deferred_steps"),
                "step_fetched": usage.get("step_fetched"),
                "step_fetched_hinted": usage.get("step_fetched_hinted"),
                "step_attended": usage.get("step_attended"),
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
                "held_tokens": usage.get("held_tokens"),
                "score": prompts.score(sample, answer.text) if trained else None,
                "error": None,
            }
        )
    counts = [answer.usage.get("selection_counts") if answer else None for answer in answers]
    return Group(
        point=index,
        scheme=scheme,
        rep=rep,
        warmup=rep < config.warmup,
        wall_s=wall,
        requests=requests,
        path_bytes={p: int(after[f"bytes.{p}"] - before[f"bytes.{p}"]) for p in TRANSFER_PATHS},
        descriptors=int(after["descriptors"] - before["descriptors"]),
        posting_s=after["posting_s"] - before["posting_s"],
        link_bytes=int(after["link_bytes"] - before["link_bytes"]),
        link_bytes_back=int(after["link_bytes_back"] - before["link_bytes_back"]),
        fetches=int(after["fetches"] - before["fetches"]),
        fetch_s=after["fetch_s"] - before["fetch_s"],
        fetch_kinds={
            kind: [
                int(after.get(f"fetches.{kind}", 0) - before.get(f"fetches.{kind}", 0)),
                after.get(f"fetch_s.{kind}", 0.0) - before.get(f"fetch_s.{kind}", 0.0),
                after.get(f"fetch_wait_s.{kind}", 0.0) - before.get(f"fetch_wait_s.{kind}", 0.0),
            ]
            for kind in FETCH_KINDS
        },
        steps=step_deltas(before, after),
        decode_threads=thread_deltas(before, after),
        prefill_threads=thread_deltas(before, after, "prefill_threads."),
        joins=[asdict(join) for join in find_joins(requests)],
        # to the last bin booked: bytes still crossing when the round settled were posted in it
        link_timeline=between(timelines, link_from, link_to),
        cpu_timeline={
            "decode": between([status["decode"].get("cpu_timeline") or {}], link_from, link_to),
            "prefill": between([node.get("cpu_timeline") or {} for node in status["prefill"]], link_from, link_to),
        },
    ), counts


def thread_deltas(before: dict[str, float], after: dict[str, float], prefix: str = "threads.") -> dict[str, float]:
    """The decode node's CPU seconds by thread role over a group (`threads.<role>` totals; the prefill nodes' with
    `prefix` "prefill_threads."), busiest first; roles that used none left out, and a role whose threads ended
    meanwhile (a link closed) counts from zero."""
    deltas = {}
    for key, value in after.items():
        if key.startswith(prefix):
            spent = value - before.get(key, 0.0)
            if spent < 0:  # its threads were replaced: what the new ones used is all there is
                spent = value
            if spent > 0:
                deltas[key.removeprefix(prefix)] = round(spent, 3)
    return dict(sorted(deltas.items(), key=lambda item: -item[1]))


def step_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, list[float]]:
    """The decode steps a group ran, by batch size: [steps, wall, CPU, emulated, link waits] (seconds), from the
    decode node's counters before and after it (`_totals`); batch sizes it ran no step at are left out."""
    batches = {key.split(".")[1] for key in after if key.startswith("steps.")}
    deltas = {
        batch: [after[f"steps.{batch}.{name}"] - before.get(f"steps.{batch}.{name}", 0.0) for name in STEP_FIELDS]
        for batch in sorted(batches, key=int)
    }
    return {batch: row for batch, row in deltas.items() if row[0] > 0}


def _settle(cluster: LocalCluster, timeout: float = 30.0) -> None:
    """Waits until the prefill nodes hold no request: late speculative pushes belong to this group's bytes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(node["requests_held"] == 0 for node in cluster.status()["prefill"]):
            return
        time.sleep(0.05)


def _run_load(
    cluster: LocalCluster,
    config: BenchConfig,
    index: int,
    point: Point,
    scheme: str,
    prompts: _Prompts,
    load: Any,
    regime: Regime,
) -> Any:
    tasks = config.tasks

    def send(i: int) -> dict[str, Any]:
        sample = prompts.sample(tasks[i % len(tasks)], point.length, config.seed + i)
        return _request(cluster.url, sample.prompt, scheme, config.output_tokens).record()

    watch = NodeWatch(cluster, regime.link_gbps, num_links=num_links(config, point)).start()
    run = run_load(send, load, index, scheme, config.seed)
    run.nodes = watch.stop(run.wall_s, run.arrivals)
    _settle(cluster)
    return run
