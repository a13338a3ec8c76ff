"""The one-command demo: a prefill node and a decode node as separate processes over a paced loopback link.

1. Profiles the model when the store has no profile for it (calibration set under samples/).
2. Pilot: unpaced nodes serve a warm-up and PILOT_RUNS full-transfer requests of a demo prompt, which
   measure the prefill as served (TTFT) and the all-local decode step (TBT), as `smartgen bench` does.
3. Picks the link rate at which a full KV transfer of the demo prompts takes `transfer_ratio` times
   that prefill (the paper's testbed: about 4.7x at 25-32 Gbit/s); with `decode_ratio`, the sleep per
   decode layer that brings an all-local step to that decode-side ratio (the paper's: about 0.15), as
   `smartgen bench --decode-ratio` sets it. Says the regime in one line: stall ratio, link, decode-side
   ratio, emulated ms per layer, CPUs split or shared, lane (and that the decode side runs at this
   machine's own speed when that puts its ratio far from the paper's).
4. Starts `smartgen serve --role prefill` and `--role decode` (with `--emulate-layer-ms` when emulating) as
   two processes on 127.0.0.1, on disjoint halves of the CPUs with `separate_cpus` (as the bench does;
   shared on one CPU or inproc).
5. Sends the same long-context prompts (passkey, needle retrieval) under each scheme, scores the
   answers, and reports every request to `progress`.
6. Stops both nodes (SIGINT) and returns the side-by-side results.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from smartgen.apps.bench.config import PAPER_STALL_RATIO, lane_words
from smartgen.apps.regime import decode_side, emulate_flags, link_for, step_selected_bytes

__all__ = [
    "DemoConfig",
    "DemoRegime",
    "SchemeResult",
    "cpu_words",
    "demo_regime",
    "last_token_time",
    "native_note",
    "run_demo",
]

PAPER_DECODE_RATIO = 0.15  # link bytes per all-local step / selected bytes per step on the paper's testbed
FAR_FACTOR = 1.5  # a decode-side ratio more than this factor off the paper's is "far from" it
PILOT_RUNS = 3  # measured pilot requests after a warm-up; the least counts (other work only ever adds time)
PILOT_TOKENS = 8  # output tokens of a pilot request: enough for a mean all-local step


@dataclass(slots=True)
class DemoConfig:
    model: Path
    db: Path | None = None
    calibration: Path | None = None
    schemes: tuple[str, ...] = ("full", "smartgen")
    tasks: tuple[str, ...] = ("passkey", "niah_single")
    length: int = 2048
    per_task: int = 3
    selector: str = "quest"
    budget: float = 0.2
    blocks: int = 1024
    transfer_ratio: float = PAPER_STALL_RATIO  # the stall ratio: full transfer / prefill as served
    # the decode-side ratio to emulate (link bytes per all-local step / selected bytes per step); None: native
    decode_ratio: float | None = PAPER_DECODE_RATIO
    lane: str = "tcp"
    lane_flags: tuple[str, ...] = ()  # `serve` flags for the lane (--rdma-device ...), given to both nodes
    separate_cpus: bool = True  # the nodes on disjoint halves of the CPUs, as the bench runs them (cluster.py)
    profile_prompts: int = 8
    seed: int = 0
    # monitoring (`demo --monitor`): told the nodes' status URLs once both are up (decode, [prefill]); and
    # called before the nodes stop, so a dashboard can keep watching until its user is done
    on_nodes: Callable[[str, list[str]], None] | None = None
    before_stop: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        if self.decode_ratio is not None and not (0 < self.decode_ratio < math.inf):
            raise ValueError(f"the decode-side ratio must be a positive number, got {self.decode_ratio}")


@dataclass(frozen=True, slots=True)
class DemoRegime:
    """The regime the demo runs in, defined as the bench defines it (smartgen/apps/bench/runner.py's Regime)."""

    lane: str
    link_gbps: float
    stall_ratio: float  # full transfer of the mean prompt's KV / its prefill as served
    prefill_s: float  # the mean prompt's prefill as served (pilot)
    step_s: float  # one all-local decode step as served (pilot), before emulation
    decode_ratio: float  # link bytes in one all-local step, emulation included / selected bytes of a step
    cpus: str  # "shared", or "prefill 0, decode 1"
    emulate_layer_ms: float = 0.0  # sleep added to every decode layer (`serve --emulate-layer-ms`); 0: native

    def __post_init__(self) -> None:
        if min(self.link_gbps, self.stall_ratio, self.prefill_s, self.step_s, self.decode_ratio) <= 0:
            raise ValueError(f"a regime's rates, times and ratios must be positive: {self}")
        if self.emulate_layer_ms < 0:
            raise ValueError(f"emulated ms per layer must be >= 0: {self}")

    def line(self) -> str:
        """The regime in one line, in the bench's words."""
        return (
            f"regime: {lane_words(self.lane)}, link {self.link_gbps * 1e3:.1f} Mbit/s, stall ratio "
            f"{self.stall_ratio:.2f} (full transfer / prefill; the paper's testbed: about {PAPER_STALL_RATIO:g}), "
            f"decode-side ratio {self.decode_ratio:.3f} (link bytes per all-local step / selected bytes per step; "
            f"the paper's: about {PAPER_DECODE_RATIO:g}), prefill {self.prefill_s * 1e3:.0f} ms, "
            f"step {self.step_s * 1e3:.0f} ms"
            + (f" + {self.emulate_layer_ms:.2f} ms/layer emulated" if self.emulate_layer_ms else "")
            + f", CPUs {self.cpus}"
        )


@dataclass(slots=True)
class SchemeResult:
    scheme: str
    ttft: list[float] = field(default_factory=list)
    ttst: list[float] = field(default_factory=list)
    tbt: list[float] = field(default_factory=list)
    last: list[float | None] = field(default_factory=list)  # the last token's arrival, from the request's
    scores: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def mean(self, name: str) -> float | None:
        values = [v for v in getattr(self, name) if v is not None]
        return statistics.mean(values) if values else None


def last_token_time(usage: dict[str, Any]) -> float | None:
    """When a request's last token arrived, from its usage: TTST plus TBT (the mean gap after the second token) for
    each token after the second; TTFT or TTST for an answer of one or two tokens."""
    tokens = int(usage.get("completion_tokens") or 0)
    if tokens >= 3 and usage.get("ttst") is not None and usage.get("tbt") is not None:
        return float(usage["ttst"]) + float(usage["tbt"]) * (tokens - 2)
    return usage.get("ttst") if tokens == 2 else usage.get("ttft")


def cpu_words(split: tuple[list[int], list[int]] | None) -> str:
    """Which CPUs the nodes run on, as the bench writes it: "shared", or "prefill 0, decode 1"."""
    if split is None:
        return "shared"
    prefill, decode = (",".join(map(str, cpus)) for cpus in split)
    return f"prefill {prefill}, decode {decode}"


def demo_regime(
    kv_bytes: float,
    selected_bytes: float,
    prefill_s: float,
    step_s: float,
    stall_ratio: float,
    lane: str,
    split: tuple[list[int], list[int]] | None,
    *,
    num_layers: int,
    decode_ratio: float | None = None,
) -> DemoRegime:
    """The link rate at which `kv_bytes` take `stall_ratio` x `prefill_s`, and the decode-side ratio that rate
    gives a step of `step_s` over `num_layers` layers against `selected_bytes` (one step's selection past the two
    layers sent whole): the native one, or with `decode_ratio` the one the bench's emulation sets."""
    from smartgen.lanes.rate import bytes_per_second

    link = link_for(kv_bytes, prefill_s, stall_ratio=stall_ratio)
    side = decode_side(decode_ratio, selected_bytes, bytes_per_second(link.link_gbps), step_s, num_layers)
    return DemoRegime(
        lane=lane,
        link_gbps=link.link_gbps,
        stall_ratio=link.stall_ratio,
        prefill_s=prefill_s,
        step_s=step_s,
        decode_ratio=side.decode_ratio,
        cpus=cpu_words(split),
        emulate_layer_ms=side.emulate_layer_ms,
    )


def native_note(regime: DemoRegime) -> str | None:
    """One line saying the decode side runs at this machine's speed, when that puts the decode-side ratio more
    than FAR_FACTOR off the paper's (so no one reads the demo's TBT as the paper's regime); else None, and None
    when the decode side is emulated (the regime line says to which ratio)."""
    if regime.emulate_layer_ms or abs(math.log(regime.decode_ratio / PAPER_DECODE_RATIO)) <= math.log(FAR_FACTOR):
        return None
    if regime.decode_ratio < PAPER_DECODE_RATIO:
        effect = "a step's link time moves less of its selection than there, so on-demand fetches stall steps more"
        how = f" (`--decode-ratio {PAPER_DECODE_RATIO:g}` emulates it)"
    else:  # emulation only ever slows a step down: no flag brings this ratio down
        effect, how = "a step's link time hides more of its selection than there", ""
    return (
        f"note: the decode side runs at this machine's own speed, decode-side ratio {regime.decode_ratio:.3f} against "
        f"the paper's {PAPER_DECODE_RATIO:g}: {effect}; this TBT is not the paper's regime{how}"
    )


def run_demo(
    config: DemoConfig,
    say: Callable[[str], None] = print,
    progress: Callable[[str, int, int], None] | None = None,
) -> tuple[list[SchemeResult], dict[str, Any]]:
    """Runs the whole demo; returns per-scheme results and a description of the setup ("regime": its DemoRegime).
    `progress(what, done, total)` hears of every request under a scheme, from done = 0 on."""
    from smartgen.apps.cluster import ClusterSpec, LocalCluster, node_cpus, post_json
    from smartgen.apps.evalsuite import generate_task, score_sample
    from smartgen.apps.stored_profile import ensure_profile
    from smartgen.lanes.rate import transfer_seconds
    from smartgen.runtime.models import kv_layout

    stored, model, tokenizer = ensure_profile(
        config.model,
        config.db,
        config.selector,
        config.budget,
        config.blocks,
        config.length,
        calibration=config.calibration,
        prompts=config.profile_prompts,
        say=say,
    )
    samples = [
        generate_task(task, config.length, config.seed + i, tokenizer, "eval", depth=(i + 0.5) / config.per_task)
        for task in config.tasks
        for i in range(config.per_task)
    ]
    tokens = [len(tokenizer(s.prompt).input_ids) for s in samples]
    mean_tokens = statistics.mean(tokens)
    layout = kv_layout(model, num_blocks=config.blocks)
    del model
    kv_bytes = layout.kv_bytes(int(mean_tokens))
    # one decode step's selection over the link: the budget of every layer past the two always sent whole
    selected_bytes = step_selected_bytes(config.budget, int(mean_tokens), layout.kv_bytes(1), layout.num_layers)
    spec = ClusterSpec(
        model=config.model,
        lane=config.lane,
        lane_flags=config.lane_flags,
        blocks=config.blocks,
        selector=config.selector,
        budget=config.budget,
        max_tokens=config.length * 2 + 64,
        db=config.db,
        separate_cpus=config.separate_cpus,
    )
    say(f"pilot: prefill and all-local decode step of {config.model.name} as served, on unpaced nodes")
    prefill_s, step_s = _pilot(spec, samples[0].prompt, post_json)
    regime = demo_regime(
        kv_bytes,
        selected_bytes,
        prefill_s * mean_tokens / tokens[0],  # the pilot's prompt to the mean prompt, prefill linear in length
        step_s,
        config.transfer_ratio,
        config.lane,
        node_cpus(config.separate_cpus, config.lane),
        num_layers=layout.num_layers,
        decode_ratio=config.decode_ratio,
    )
    say(regime.line())
    if note := native_note(regime):
        say(note)
    setup = {
        "model": config.model.name,
        "prompt_tokens": round(mean_tokens),
        "prefill_s": regime.prefill_s,
        "kv_mib": kv_bytes / 2**20,
        "link_gbps": regime.link_gbps,
        "transfer_s": transfer_seconds(kv_bytes, regime.link_gbps),
        "selector": f"{config.selector} {config.budget:g}",
        "profile": stored.id,
        "regime": regime,
    }
    total = len(config.schemes) * len(samples)
    report = progress or (lambda what, done, total: None)
    emulate = emulate_flags(regime.emulate_layer_ms)  # the prefill node's decode steps (forecast, head start) too
    paced = replace(
        spec, link_gbps=regime.link_gbps, decode_extra=emulate, prefill_extra=(*spec.prefill_extra, *emulate)
    )
    with LocalCluster(paced) as cluster:
        where = "in one process (inproc lane)" if cluster.colocated else f"over the {config.lane} lane"
        say(f"prefill node and decode node up {where}, OpenAI API on {cluster.url}/v1")
        if config.on_nodes is not None:
            config.on_nodes(cluster.url, [f"http://{address}" for address in cluster.prefill_status])
        results = []
        done = 0
        report(config.schemes[0] if config.schemes else "", done, total)
        for scheme in config.schemes:
            result = SchemeResult(scheme)
            for sample in samples:
                body = {
                    "prompt": sample.prompt,
                    "max_tokens": sample.max_new_tokens,
                    "temperature": 0,
                    "scheme": scheme,
                }
                try:
                    answer = post_json(f"{cluster.url}/v1/completions", body)
                except OSError as exc:
                    result.errors.append(str(exc))
                else:
                    usage = answer["usage"]
                    result.ttft.append(usage["ttft"])
                    result.ttst.append(usage["ttst"])
                    result.tbt.append(usage["tbt"])
                    result.last.append(last_token_time(usage))
                    result.scores.append(score_sample(sample, answer["choices"][0]["text"]))
                done += 1
                report(scheme, done, total)
            say(f"{scheme}: {len(result.scores)} requests done")
            results.append(result)
        if config.before_stop is not None:
            config.before_stop()
        return results, setup


def _pilot(spec: Any, prompt: str, post_json: Callable[..., dict[str, Any]]) -> tuple[float, float]:
    """(prefill s, all-local step s) of `prompt` under full transfer on unpaced nodes: the least of PILOT_RUNS
    requests after a warm-up one (a node's first request pays for its warm-up)."""
    from smartgen.apps.cluster import LocalCluster

    body = {"prompt": prompt, "max_tokens": PILOT_TOKENS, "temperature": 0, "ignore_eos": True, "scheme": "full"}
    with LocalCluster(spec) as cluster:
        runs = [post_json(f"{cluster.url}/v1/completions", body)["usage"] for _ in range(PILOT_RUNS + 1)]
    return min(float(u["ttft"]) for u in runs[1:]), min(float(u["tbt"]) for u in runs[1:])
