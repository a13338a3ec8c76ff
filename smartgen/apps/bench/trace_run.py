"""Trace mode's runs: per offered rate and scheme, fresh nodes with prefix caches on replay the same trace slice.

1. The slice (trace.py) is read once; with --load-rate each rate rescales its arrival times to that mean rate,
   else it keeps --time-scale's.
2. Per rate, full transfer first, then the other schemes: fresh nodes (so no scheme finds another's prompts in its
   caches) with both prefix caches on at --trace-cache-bytes and cache blocks of the trace's block size (so a hash
   id is one cache block), a warm-up request of tokens no trace prompt has, then the replay: every request at its
   time, on its own thread, whatever the nodes' state (load.replay); requests over --max-input were clipped or are
   recorded refused without being sent. NodeWatch (watch.py) records link bytes, prefix-cache hits and queues.
3. With --slo-from-full X, the first full-transfer nodes also serve two unloaded requests of the reference length
   (alone, before the replay); the SLOs are X times the second one's TTFT and TBT, as the client saw them.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from smartgen.apps.bench.config import BenchConfig, Point
from smartgen.apps.bench.goodput import SLOs
from smartgen.apps.bench.load import LoadRun, replay
from smartgen.apps.bench.phases import Phases
from smartgen.apps.bench.results import Regime
from smartgen.apps.bench.trace import TraceRequest, TraceSlice, prompt_text, prompt_tokens
from smartgen.apps.bench.watch import NodeWatch, num_links, read_link, served_model
from smartgen.apps.cluster import ClusterSpec, LocalCluster

__all__ = ["run_trace_point", "trace_spec", "reference_length", "WARM_SEED"]

WARM_SEED = -1  # prompt seed of warm-up and SLO requests: block ids of their own, never a trace prompt's
UNLOADED_RUNS = 2  # unloaded requests for --slo-from-full: the first warms the paced link, the second is measured


def reference_length(trace: TraceSlice) -> int:
    """The slice's median prompt length (at least 64 tokens): where the pilot sets the stall ratio's link rate."""
    return max(64, round(statistics.median(r.input_tokens for r in trace.requests)))


def trace_spec(config: BenchConfig, spec: ClusterSpec, trace: TraceSlice) -> ClusterSpec:
    """The nodes of a trace replay: both prefix caches on, one cache block per hash id, room for the longest
    request."""
    assert config.trace is not None
    sent = [r for r in trace.requests if not r.refused] or trace.requests
    longest = max(r.input_tokens + r.output_tokens for r in sent)
    block = ("--prefix-block-tokens", str(trace.block_tokens))
    return replace(
        spec,
        max_tokens=max(spec.max_tokens, longest + 64),
        prefill_cache=str(config.trace.cache_bytes),
        decode_cache=str(config.trace.cache_bytes),
        prefill_extra=(*spec.prefill_extra, *block),
        decode_extra=(*spec.decode_extra, *block),
    )


def run_trace_point(
    config: BenchConfig,
    index: int,
    point: Point,
    spec: ClusterSpec,
    regime: Regime,
    trace: TraceSlice,
    vocab: int,
    request: Callable[..., Any],
    phases: Phases,
    say: Callable[[str], None],
    words: list[str] | None = None,
) -> list[LoadRun]:
    """Every rate, scheme and router policy of one point; `request(url, prompt, scheme, max_tokens)` streams one
    completion (runner._request); `words` (trace.single_token_words): the prompts' words where a router places them.
    Returns a LoadRun per (rate, scheme, policy), rates in order, full transfer first in each."""
    assert config.trace is not None
    spec = trace_spec(config, spec, trace)
    schemes = ["full", *(s for s in config.all_schemes if s != "full")]
    slices = [trace.rescaled(rate) for rate in config.load_rate] if config.load_rate else [trace]
    skipped = {i: _refusal(r, config) for i, r in enumerate(trace.requests) if r.refused}
    slos = config.slos()
    runs = []
    routers: list[str | None] = list(config.routers) or [None]
    for part in slices:
        rate = part.offered_rate
        for scheme, router in itertools.product(schemes, routers):
            label = scheme if router is None else f"{scheme}/{router}"
            phases.say(f"{label}: starting fresh nodes for the trace")
            with _nodes(spec, router, config) as (cluster, url):
                regime.link = read_link(cluster.url)
                model = served_model(cluster.url)
                for warm_url in cluster.urls or [url]:  # every decode node's first request is a warm-up
                    request(warm_url, _warm_prompt(trace, point.length, vocab, config.seed * 7919 + 1), "full", 4)
                if config.trace.slo_from_full is not None and scheme == "full" and part is slices[0]:
                    unloaded = [
                        _warm_prompt(trace, point.length, vocab, config.seed * 7919 + 2 + run)
                        for run in range(UNLOADED_RUNS)
                    ]
                    slos = _slos_from_full(cluster, config, unloaded, request, say)

                def send(
                    i: int, url: str = url, scheme: str = scheme, text: bool = router is not None, name: str = model
                ) -> dict[str, Any]:
                    # built as it is sent, not all at once (a whole trace at full length is billions of ids); the
                    # client's clock starts after. trace.requests[i] is part.requests[i] but for its time. Through
                    # the router, as text: it refuses token ids
                    r = trace.requests[i]
                    if not text:
                        prompt = prompt_tokens(r, trace.block_tokens, vocab, config.seed)
                        return request(url, prompt, scheme, r.output_tokens).record()
                    text_prompt = prompt_text(r, trace.block_tokens, words or [], config.seed)
                    # the router's request type requires the model's name (the node's own API does not)
                    return request(url, text_prompt, scheme, r.output_tokens, {"model": name}).record()

                watch = NodeWatch(cluster, regime.link_gbps, num_links=num_links(config, point)).start()
                records, wall = replay(send, [r.at_s for r in part.requests], skipped)
                nodes = watch.stop(wall, len(records) - len(skipped))
            for record, r in zip(records, part.requests):
                record.update(trace_index=r.index, hash_blocks=len(r.hash_ids), clipped=r.clipped)
            run = LoadRun(
                index, scheme, rate, part.span_s, wall, slos, records, mode="trace", nodes=nodes, router=router
            )
            runs.append(run)
            phases.step(f"{label}: replayed {len(records)} requests")
    return runs


@contextmanager
def _nodes(spec: ClusterSpec, router: str | None, config: BenchConfig) -> Iterator[tuple[LocalCluster, str]]:
    """Fresh nodes, and the URL requests go to: the decode node's, or with `router` SGLang's router in front of
    every decode node (scale_out.ScaleOut), on a free port."""
    if router is None:
        with LocalCluster(spec) as cluster:
            yield cluster, cluster.url
        return
    from smartgen.apps.scale_out import RouterSpec, ScaleOut

    assert config.router_python is not None  # runner.run_bench found it (router.ensure_router) before any node started
    with ScaleOut(spec, RouterSpec(config.router_python, router, port=0)) as scale:
        yield scale.cluster, scale.url


def _refusal(request: TraceRequest, config: BenchConfig) -> str:
    assert config.trace is not None
    return f"over --max-input {config.trace.max_input} tokens (--over-length refuse): not sent"


def _warm_prompt(trace: TraceSlice, length: int, vocab: int, seed: int) -> list[int]:
    """`length` tokens from block ids no trace request has (negative) and a seed of their own: a prompt that shares
    no cache block with the trace's or with another seed's."""
    blocks = -(-length // trace.block_tokens)
    ids = tuple(range(-1, -blocks - 1, -1))
    return prompt_tokens(TraceRequest(-1, 0.0, length, 4, ids), trace.block_tokens, vocab, seed)


def _slos_from_full(
    cluster: LocalCluster,
    config: BenchConfig,
    prompts: list[list[int]],
    request: Callable[..., Any],
    say: Callable[[str], None],
) -> SLOs:
    """X times full transfer's unloaded TTFT and TBT at the reference length: the last of `prompts` (none of which
    the caches hold), each sent alone."""
    assert config.trace is not None and config.trace.slo_from_full is not None
    factor = config.trace.slo_from_full
    timings: dict[str, Any] = {}
    for prompt in prompts:
        timings = request(cluster.url, prompt, "full", config.output_tokens).record()
    ttft, tbt = timings.get("ttft"), timings.get("tbt")
    if ttft is None or tbt is None:
        raise RuntimeError("--slo-from-full: full transfer's unloaded request streamed too few tokens to time")
    slos = SLOs(factor * ttft, config.slo_ttst_s, factor * tbt)
    say(
        f"SLOs from full transfer unloaded x {factor:g}: TTFT {factor * ttft * 1e3:.0f} ms, TBT {factor * tbt * 1e3:.1f} ms"
    )
    return slos
