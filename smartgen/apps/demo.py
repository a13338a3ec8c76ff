"""The one-command demo: a prefill node and a decode node as separate processes over a paced loopback link.

1. Profiles the model when the store has no profile for it (calibration set under samples/).
2. Picks a link rate at which a full KV transfer of the demo prompts takes `transfer_ratio`
   times their prefill, as on the paper's testbed (4.7x at 25-32 Gbit/s).
3. Starts `smartgen serve --role prefill` and `--role decode` as two processes on 127.0.0.1.
4. Sends the same long-context prompts (passkey, needle retrieval) under each scheme and
   scores the answers.
5. Stops both nodes (SIGINT) and returns the side-by-side results.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DemoConfig", "SchemeResult", "run_demo"]


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
    transfer_ratio: float = 5.0
    lane: str = "tcp"
    lane_flags: tuple[str, ...] = ()  # `serve` flags for the lane (--rdma-device ...), given to both nodes
    profile_prompts: int = 8
    seed: int = 0
    # monitoring (`demo --monitor`): told the nodes' status URLs once both are up (decode, [prefill]); and
    # called before the nodes stop, so a dashboard can keep watching until its user is done
    on_nodes: Callable[[str, list[str]], None] | None = None
    before_stop: Callable[[], None] | None = None


@dataclass(slots=True)
class SchemeResult:
    scheme: str
    ttft: list[float] = field(default_factory=list)
    ttst: list[float] = field(default_factory=list)
    tbt: list[float] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def mean(self, name: str) -> float | None:
        values = [v for v in getattr(self, name) if v is not None]
        return statistics.mean(values) if values else None


def run_demo(config: DemoConfig, say: Callable[[str], None] = print) -> tuple[list[SchemeResult], dict]:
    """Runs the whole demo; returns per-scheme results and a description of the setup."""
    from smartgen.apps.evalsuite import generate_task, score_sample
    from smartgen.apps.stored_profile import ensure_profile
    from smartgen.lanes.rate import gbps_for, transfer_seconds
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
    mean_tokens = statistics.mean(len(tokenizer(s.prompt).input_ids) for s in samples)
    prefill_seconds = stored.prefill_seconds_per_token * mean_tokens
    layout = kv_layout(model, num_blocks=config.blocks)
    kv_bytes = layout.kv_bytes(int(mean_tokens))
    gbps = gbps_for(kv_bytes, config.transfer_ratio * prefill_seconds)
    setup = {
        "model": config.model.name,
        "prompt_tokens": round(mean_tokens),
        "prefill_s": prefill_seconds,
        "kv_mib": kv_bytes / 2**20,
        "link_gbps": gbps,
        "transfer_s": transfer_seconds(kv_bytes, gbps),
        "selector": f"{config.selector} {config.budget:g}",
        "profile": stored.id,
        "stall_ratio": config.transfer_ratio,
        # one decode step's selection over the link: the budget of every layer past the two always sent whole
        "selected_bytes": config.budget * layout.kv_bytes(int(mean_tokens), num_layers=max(layout.num_layers - 2, 1)),
    }
    say(
        f"link paced at {gbps * 1000:.1f} Mbit/s: a full transfer of {setup['kv_mib']:.1f} MiB takes "
        f"{setup['transfer_s']:.2f} s vs {prefill_seconds:.2f} s of prefill ({config.transfer_ratio:g}x)"
    )
    del model
    from smartgen.apps.cluster import ClusterSpec, LocalCluster, post_json

    spec = ClusterSpec(
        model=config.model,
        link_gbps=gbps,
        lane=config.lane,
        lane_flags=config.lane_flags,
        blocks=config.blocks,
        selector=config.selector,
        budget=config.budget,
        max_tokens=config.length * 2 + 64,
        db=config.db,
    )
    with LocalCluster(spec) as cluster:
        where = "in one process (inproc lane)" if cluster.colocated else f"over the {config.lane} lane"
        say(f"prefill node and decode node up {where}, OpenAI API on {cluster.url}/v1")
        if config.on_nodes is not None:
            config.on_nodes(cluster.url, [f"http://{address}" for address in cluster.prefill_status])
        results = []
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
                    continue
                usage = answer["usage"]
                result.ttft.append(usage["ttft"])
                result.ttst.append(usage["ttst"])
                result.tbt.append(usage["tbt"])
                result.scores.append(score_sample(sample, answer["choices"][0]["text"]))
            say(f"{scheme}: {len(result.scores)} requests done")
            results.append(result)
        if config.before_stop is not None:
            config.before_stop()
        return results, setup


def decode_side_ratio(setup: dict[str, Any], step_s: float) -> float:
    """Bytes the demo's link moves during one all-local decode step of `step_s` / one step's selected bytes (the
    paper's testbed: about 0.15; far below it every remote entry stalls a step)."""
    from smartgen.lanes.rate import bytes_per_second

    return bytes_per_second(setup["link_gbps"]) * step_s / setup["selected_bytes"]
