"""What a benchmark runs: schemes, the regime (stall ratio or link rate, decode-side ratio) and the sweeps."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from smartgen.apps.bench.models import check_model_spec
from smartgen.engine.policy import check_servable, get_policy

__all__ = [
    "BenchConfig",
    "LoadSpec",
    "TraceSpec",
    "Point",
    "DEFAULT_SCHEMES",
    "DEFAULT_STRATEGIES",
    "DEFAULT_TASKS",
    "lane_words",
]

DEFAULT_SCHEMES = (
    "full",
    "partial",
    "partial+profile",
    "partial+profile+parallel",
    "smartgen-paper",
    "smartgen",
    "proactive-only",
    "quant2",
)
# the second comparison: SmartGen with other proactive sets ("optimal" needs the request's own future
# selections, which a serving node cannot know; `smartgen simulate --strategy optimal` runs it)
DEFAULT_STRATEGIES = ("random", "sequential", "streaming", "optimal")
DEFAULT_TASKS = ("passkey", "niah_single")
PREFIX_CACHE_SIDES = ("prefill", "decode", "both")
# how the decode-side ratio's step is emulated (runtime/emulation.py): a sleep added to every layer, or every layer
# topped up to a floor (a batch's step then costs one request's, as on a GPU)
DECODE_EMULATIONS = ("added", "floor")
SERVE_MAX_BATCH = 8  # `smartgen serve --max-batch`'s default: load and trace modes' decode node, unless given
PAPER_STALL_RATIO = 4.7  # full transfer / prefill on the paper's testbed (25-32 Gbit/s)


def lane_words(lane: str) -> str:
    """Which lane ran, and so how many processes: the in-process lane is one `serve --role both`."""
    return "inproc lane (one process)" if lane == "inproc" else f"{lane} lane (separate processes)"


@dataclass(frozen=True, slots=True)
class Point:
    """One setting of every swept knob. The node-level ones need their own pair of nodes."""

    batch: int
    length: int
    link: float  # the stall ratio (full transfer / prefill) or Gbit/s, as BenchConfig.link_mode says
    blocks: int
    budget: float
    speculative_ratio: float
    prefill_nodes: int
    prefix_hit: float | None = None  # share of each prompt the prefix cache already holds; None: caches off

    def node_key(self) -> tuple[float, int, float, float, int]:
        """What the nodes are started with: points that share it share nodes."""
        return (self.link, self.blocks, self.budget, self.speculative_ratio, self.prefill_nodes)

    def label(self, link_mode: str) -> str:
        link = f"stall {self.link:g}x" if link_mode == "stall" else f"{self.link:g} Gbit/s"
        return (
            f"batch {self.batch}, {self.length} tokens, {link}, M={self.blocks}, budget {self.budget:g}, "
            f"spec {self.speculative_ratio:g}, {self.prefill_nodes} prefill node{'s' * (self.prefill_nodes > 1)}"
            + ("" if self.prefix_hit is None else f", prefix hit {self.prefix_hit:.0%}")
        )


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load mode: Poisson arrivals at `rate` for `duration`, and the objectives goodput counts against (None: off)."""

    rate: float  # requests per second, offered
    duration_s: float = 30.0  # arrival window
    slo_ttft_s: float | None = 2.0
    slo_tbt_s: float | None = 0.2
    slo_ttst_s: float | None = None

    def __post_init__(self) -> None:
        if not self.rate > 0 or not self.duration_s > 0:
            raise ValueError("--load-rate and --load-duration must be positive")
        self.slos()  # its own checks

    def slos(self) -> Any:
        """The objectives as goodput.SLOs."""
        from smartgen.apps.bench.goodput import SLOs  # goodput imports stats, which imports this module

        return SLOs(self.slo_ttft_s, self.slo_ttst_s, self.slo_tbt_s)


@dataclass(frozen=True, slots=True)
class TraceSpec:
    """Trace mode (trace.py): which slice of a Mooncake-format trace is replayed, scaled how, on what nodes."""

    path: Path
    time_scale: float = 1.0
    length_scale: float = 1.0
    start: int = 0  # requests of the file skipped
    max_requests: int | None = None
    max_input: int | None = None  # prompt tokens; longer ones are clipped or refused (over_length)
    over_length: str = "clip"
    cache_bytes: int = 2**30  # each node's prefix cache (`serve --prefix-cache-bytes`)
    slo_from_full: float | None = None  # SLOs = this x full transfer's unloaded TTFT and TBT

    def __post_init__(self) -> None:
        from smartgen.apps.bench.trace import OVER_LENGTH, block_tokens_for

        if not self.time_scale > 0:
            raise ValueError("--time-scale must be positive")
        block_tokens_for(self.length_scale)  # its own check
        if self.start < 0 or (self.max_requests is not None and self.max_requests < 1):
            raise ValueError("--start must be >= 0 and --max-requests >= 1")
        if self.max_input is not None and self.max_input < 1:
            raise ValueError("--max-input must be at least 1 token")
        if self.over_length not in OVER_LENGTH:
            raise ValueError(f"--over-length must be one of {', '.join(OVER_LENGTH)}")
        if self.slo_from_full is not None and not self.slo_from_full > 0:
            raise ValueError("--slo-from-full must be positive")
        if self.cache_bytes <= 0:
            raise ValueError("--trace-cache-bytes must be positive: trace mode replays the trace's prefix reuse")

    def read(self) -> Any:
        """The replayed slice (trace.TraceSlice); ValueError for a file that is not such a trace."""
        from smartgen.apps.bench.trace import read_trace

        return read_trace(
            self.path,
            time_scale=self.time_scale,
            length_scale=self.length_scale,
            start=self.start,
            max_requests=self.max_requests,
            max_input=self.max_input,
            over_length=self.over_length,
        )


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """A whole benchmark run; every tuple field is a sweep (one value = no sweep)."""

    model: str = "sample"  # "sample", "random:LAYERS" (random weights, the sample's shape) or a model folder
    schemes: tuple[str, ...] = DEFAULT_SCHEMES
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    selector: str = "quest"
    lane: str = "tcp"
    lane_flags: tuple[str, ...] = ()  # `serve` flags for the lane (--rdma-device ...), given to every node
    batch: tuple[int, ...] = (1,)
    lengths: tuple[int, ...] = (2048,)
    stall_ratio: tuple[float, ...] = (PAPER_STALL_RATIO,)
    link_gbps: tuple[float, ...] = ()  # when given, replaces stall_ratio
    decode_ratio: float | None = None  # link bytes per all-local step / selected bytes per step; None = native
    decode_emulation: str = "added"  # how that step is emulated: "added" to each layer, or each layer's "floor"
    separate_cpus: bool = True  # prefill and decode nodes on disjoint CPUs, as on separate machines (cluster.py)
    device: str = "cpu"  # every node's `serve --device` (cuda:0 on a GPU machine)
    blocks: tuple[int, ...] = (1024,)
    budget: tuple[float, ...] = (0.2,)
    speculative_ratio: tuple[float, ...] = (0.1,)
    prefill_nodes: tuple[int, ...] = (1,)
    # sweep of the prefix hit rate (shares in [0, 1)); empty: the nodes' prefix caches stay off
    prefix_hit: tuple[float, ...] = ()
    prefix_cache: str = "prefill"  # which node caches in the sweep: prefill, decode or both
    output_tokens: int = 64
    reps: int = 3
    warmup: int = 1
    tasks: tuple[str, ...] = DEFAULT_TASKS  # eval-suite tasks the prompts come from, in turn
    seed: int = 0
    # load mode (`--load-rate`): Poisson arrivals for load_duration_s per scheme and rate instead of rounds, goodput
    # under the SLOs (None: not checked); with a trace, each rate rescales the trace's arrival times instead
    load_rate: tuple[float, ...] = ()
    load_duration_s: float = 30.0
    slo_ttft_s: float | None = 2.0
    slo_tbt_s: float | None = 0.2
    slo_ttst_s: float | None = None
    trace: TraceSpec | None = None  # trace mode: replay this trace (trace.py) instead of rounds or Poisson arrivals
    # the decode node's --max-batch; None: serve's own default (8) in load and trace modes, whose arrivals decide how
    # many decode at once, else the largest batch of the rounds
    max_batch: int | None = None
    # one paced link into the decode node that every prefill node's bytes cross (`serve --ingress-gbps` at the
    # regime's rate), as the paper's DP 6 -> 1 shares the decode machine's NIC; each prefill node still sends at
    # that rate too (its own NIC), so with one prefill node the two pacings agree
    shared_link: bool = False
    decode_nodes: int = 1  # trace mode: more than one stand behind SGLang's router, one run per --router policy
    routers: tuple[str, ...] = ()  # the router's policies (router.POLICIES), each a run of its own per scheme
    router_python: Path | None = None  # a Python with sglang_router; None: router.ensure_router's venv
    db: Path | None = None
    out: Path | None = None

    def __post_init__(self) -> None:
        from smartgen.runtime.models import ModelLoadError, check_device

        try:
            check_device(self.device)
        except ModelLoadError as exc:
            raise ValueError(f"--device: {exc}") from None
        check_model_spec(self.model)
        for scheme in self.all_schemes:
            # unknown or unservable ones fail before any node starts; the optimal set is replayed from full's run
            check_servable(get_policy(scheme), oracle=True)
        if self.reps < 1:
            raise ValueError("--reps must be at least 1")
        if self.output_tokens < 3:
            raise ValueError("--output-tokens must be at least 3 (TBT needs a third token)")
        from smartgen.apps.evalsuite import TASKS  # the eval suite's task registry

        if not self.tasks or (unknown := [t for t in self.tasks if t not in TASKS]):
            got = f"unknown: {', '.join(unknown)}" if self.tasks else "none given"
            raise ValueError(f"--tasks must name some of {', '.join(TASKS)} ({got})")
        if "full" not in self.schemes:
            raise ValueError("the schemes must include full: every ratio is against full transfer")
        checks = {
            "batch": (self.batch, 1),
            "lengths": (self.lengths, 64),
            "blocks": (self.blocks, 1),
            "prefill-nodes": (self.prefill_nodes, 1),
        }
        for name, (values, least) in checks.items():
            if not values or min(values) < least:
                raise ValueError(f"--{name} values must be at least {least}")
        rates = self.link_gbps or self.stall_ratio
        if not rates or min(rates) <= 0:
            raise ValueError("link rates and stall ratios must be positive")
        if not self.budget or not all(0 < b <= 1 for b in self.budget):
            raise ValueError("--budget values must be shares of the prompt in (0, 1]")
        if not self.speculative_ratio or not all(0 < r <= 1 for r in self.speculative_ratio):
            raise ValueError("--speculative-ratio values must be in (0, 1]")
        if not all(0 <= h < 1 for h in self.prefix_hit):
            raise ValueError("--prefix-hit values must be percentages in [0, 100)")
        if self.prefix_cache not in PREFIX_CACHE_SIDES:
            raise ValueError(f"--prefix-cache must be one of {', '.join(PREFIX_CACHE_SIDES)}")
        if self.prefix_hit and self.loaded:
            raise ValueError("--prefix-hit runs in rounds; it does not combine with --load-rate or --trace")
        if any(not r > 0 for r in self.load_rate):
            raise ValueError("--load-rate values must be positive")
        if self.lane == "inproc" and max(self.prefill_nodes) > 1:
            raise ValueError("--lane inproc runs one prefill node beside the decode node: --prefill-nodes must be 1")
        if self.lane == "inproc" and self.prefix_hit and self.prefix_cache != "both":
            raise ValueError("--lane inproc sizes both nodes' prefix caches alike: use --prefix-cache both")
        if self.loaded and self.batch != (1,):
            raise ValueError(
                "--batch sweeps requests sent together in rounds; load and trace modes send them on their own clock: "
                "set how many decode at once with --max-batch instead"
            )
        if self.max_batch is not None and self.max_batch < 1:
            raise ValueError("--max-batch must be at least 1")
        if self.shared_link and self.lane not in ("tcp",):
            raise ValueError(f"--shared-link paces what the tcp lane's sockets read; --lane {self.lane} cannot")
        if self.decode_nodes < 1:
            raise ValueError("--decode-nodes must be at least 1")
        if self.decode_nodes > 1 and (self.trace is None or not self.routers):
            raise ValueError("--decode-nodes above 1 runs in trace mode behind the router: give --trace and --router")
        if self.routers and self.decode_nodes < 2:
            raise ValueError("--router places requests over decode nodes: give --decode-nodes 2 or more")
        from smartgen.apps.router import POLICIES

        if unknown := [r for r in self.routers if r not in POLICIES]:
            raise ValueError(f"--router policies are {', '.join(POLICIES)} (unknown: {', '.join(unknown)})")
        if self.decode_ratio is not None and self.decode_ratio <= 0:
            raise ValueError("--decode-ratio must be positive")
        if self.decode_emulation not in DECODE_EMULATIONS:
            raise ValueError(
                f"--decode-emulation is one of {', '.join(DECODE_EMULATIONS)}, got {self.decode_emulation!r}"
            )
        self.load_spec()  # its own checks
        self.slos()
        if self.needs_oracle and self.loaded:
            raise ValueError(
                "the optimal strategy replays full transfer's run of the same prompt, which load and trace modes have "
                "not: leave it out of --strategies with --load-rate or --trace"
            )
        if self.needs_oracle and self.prefix_hit:
            raise ValueError(
                "the optimal strategy replays full transfer's run of the same prompt, and a --prefix-hit point "
                "gives every scheme prompts of its own: leave it out of --strategies with --prefix-hit"
            )

    def load_spec(self, rate: float | None = None) -> LoadSpec | None:
        """The load mode's LoadSpec at `rate` (default: the first of --load-rate), or None when the run is in rounds
        or replays a trace."""
        if not self.load_rate or self.trace is not None:
            return None
        return LoadSpec(
            rate or self.load_rate[0], self.load_duration_s, self.slo_ttft_s, self.slo_tbt_s, self.slo_ttst_s
        )

    def slos(self) -> Any:
        """The objectives goodput counts against (goodput.SLOs)."""
        from smartgen.apps.bench.goodput import SLOs

        return SLOs(self.slo_ttft_s, self.slo_ttst_s, self.slo_tbt_s)

    @property
    def node_batch(self) -> int:
        """The decode node's --max-batch: as given, else serve's own default (8) in load and trace modes, whose
        requests come on their own clock (a default of the largest --batch, 1, would queue every arrival for one
        decode slot), else the largest --batch."""
        return self.max_batch or (SERVE_MAX_BATCH if self.loaded else max(self.batch))

    @property
    def loaded(self) -> bool:
        """Whether requests come on their own clock (load or trace mode) rather than in rounds."""
        return bool(self.load_rate) or self.trace is not None

    @property
    def all_schemes(self) -> tuple[str, ...]:
        """The schemes, then SmartGen with each other proactive-set strategy."""
        return self.schemes + tuple(f"smartgen[{s}]" for s in self.strategies if s != "profile")

    @property
    def needs_oracle(self) -> bool:
        """Whether a scheme runs the optimal proactive set, which replays full transfer's selections."""
        return "optimal" in self.strategies

    @property
    def link_mode(self) -> str:
        return "gbps" if self.link_gbps else "stall"

    def points(self) -> list[Point]:
        """Every combination of the sweeps, grouped so points sharing nodes run one after another."""
        links = self.link_gbps or self.stall_ratio
        hits: tuple[float | None, ...] = self.prefix_hit or (None,)
        combos = itertools.product(
            links, self.blocks, self.budget, self.speculative_ratio, self.prefill_nodes, self.lengths, self.batch, hits
        )
        return [Point(b, n, link, m, budget, spec, p, h) for link, m, budget, spec, p, n, b, h in combos]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["db"] = str(self.db) if self.db else None
        data["out"] = str(self.out) if self.out else None
        if self.trace is not None:
            data["trace"]["path"] = str(self.trace.path)
        data["router_python"] = str(self.router_python) if self.router_python else None
        return data
