"""What a benchmark run measured: the regime of each point, each scheme's rounds, and the whole run's record."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from smartgen.apps.bench.config import BenchConfig, Point

__all__ = ["BenchResult", "Group", "Regime"]


@dataclass(slots=True)
class Regime:
    """The link and the decode side of one group of points, as set and as measured by the pilot."""

    link_gbps: float
    stall_ratio: float  # full transfer of one request / its prefill (at the reference length)
    reference_length: int
    prefill_s: dict[int, float]  # prompt length -> prefill as served (pilot TTFT)
    step_s: dict[int, float]  # prompt length -> all-local decode step (pilot TBT, before emulation)
    emulate_layer_ms: float  # sleep added to each decode layer (0 with a floor)
    decode_ratio: float  # link bytes in one all-local step / selected bytes of a step (estimated)
    kv_bytes_per_token: int
    num_layers: int
    cpus: str = "shared"  # which CPUs the nodes ran on: "shared", or "prefill 0, decode 1" (ClusterSpec.separate_cpus)
    # the decode node's /status "link" as its nodes ran (pacing: "per prefill node" or "shared ingress", ingress_gbps)
    link: dict[str, Any] = field(default_factory=dict)
    # prompt length -> batch -> the all-local step with that many requests decoding together (pilot, client's clock,
    # before emulation; local_step.py); batch 1 is step_s
    batch_step_s: dict[int, dict[int, float]] = field(default_factory=dict)
    emulate_floor_ms: float = 0.0  # or: each decode layer topped up to this much compute (`--decode-emulation floor`)


@dataclass(slots=True)
class Group:
    """One scheme, one round of one point: a batch of concurrent requests and what the link carried for them."""

    point: int
    scheme: str
    rep: int
    warmup: bool
    wall_s: float
    requests: list[dict[str, Any]]
    path_bytes: dict[str, int]
    descriptors: int
    posting_s: float
    link_bytes: int  # sent by the prefill nodes (push and control lanes): the KV's direction
    link_bytes_back: int = 0  # sent by the decode node (fetch requests, idle notices): the other direction
    fetches: int = 0  # fetch replies the decode node landed (on demand and prefetched)
    fetch_s: float = 0.0  # their summed time from sending the FETCH to landing the reply
    # by kind (metrics.FETCH_KINDS: a step's own, prefetch, forecast): [replies landed, their summed time from
    # sending to arrival, the decode steps' summed waits for replies of the kind] (results before the third keep two)
    fetch_kinds: dict[str, list[float]] = field(default_factory=dict)
    # the decode node's steps by batch size: [steps, wall, its thread's CPU, emulated compute, link waits] (seconds)
    steps: dict[str, list[float]] = field(default_factory=dict)
    joins: list[dict[str, Any]] = field(default_factory=list)  # joins.Join of each request that joined others
    # the decode node's CPU seconds over the group by thread role (roles/thread_cpu.py), busiest first: what shared
    # its CPU with the decode step
    decode_threads: dict[str, float] = field(default_factory=dict)
    # the same for the prefill nodes (summed by role): what shared their CPUs with prefill and forecast steps
    prefill_threads: dict[str, float] = field(default_factory=dict)
    # what the prefill nodes' links carried toward the decode node, by tag, bytes in each second of the pacers' clock
    # from the one the round started in to the one it settled in (lanes/link_timeline.py; {} unpaced): link.png
    link_timeline: dict[str, list[int]] = field(default_factory=dict)
    # the nodes' CPU milliseconds by thread role in each second of the round, the same seconds as link_timeline:
    # {"decode": {role: [ms, ...]}, "prefill": {...}} (the prefill nodes summed; roles/cpu_timeline.py; one process
    # under --lane inproc, shown under both)
    cpu_timeline: dict[str, dict[str, list[int]]] = field(default_factory=dict)


@dataclass(slots=True)
class BenchResult:
    config: BenchConfig
    model: str
    trained: bool
    points: list[Point]
    regimes: list[Regime]  # one per point
    groups: list[Group] = field(default_factory=list)
    loads: list[Any] = field(default_factory=list)  # load and trace modes: a LoadRun per point, rate and scheme
    trace: dict[str, Any] | None = None  # trace mode: the replayed slice (TraceSlice.to_json())
    machine: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    phases: list[dict[str, Any]] = field(default_factory=list)  # Phases.to_json(): where the run's time went

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config.to_json(),
            "model": self.model,
            "trained": self.trained,
            "machine": self.machine,
            "notes": self.notes,
            "phases": self.phases,
            "points": [{**asdict(p), "regime": asdict(r)} for p, r in zip(self.points, self.regimes)],
            "groups": [asdict(g) for g in self.groups],
            "loads": [run.to_json() for run in self.loads],
            "trace": self.trace,
        }
