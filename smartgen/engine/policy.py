"""Transfer policies: SmartGen, its baselines and ablations, as settings of one engine."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from smartgen.engine.kv_quant import SERVING_QUANT, quant_unsupported
from smartgen.engine.planning import STRATEGIES

__all__ = [
    "Policy",
    "POLICIES",
    "get_policy",
    "check_servable",
    "check_quantizable",
    "split_label",
    "ProactiveMode",
    "Strategy",
]


class _Named(str, Enum):
    """An enum that is its value wherever a string is: printed, formatted, compared, sent as JSON."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class ProactiveMode(_Named):
    """What a policy pushes during prefill: every block, layers 0-1 only, or layers 0-1 plus K_r blocks."""

    ALL = "all"
    FLOOR = "floor"
    BUDGET = "budget"


class Strategy(_Named):
    """How the proactive set is chosen (engine.planning.strategy_scores)."""

    PROFILE = "profile"
    QUERY = "query"
    RANDOM = "random"
    SEQUENTIAL = "sequential"
    STREAMING = "streaming"
    OPTIMAL = "optimal"


assert {s.value for s in Strategy} == set(STRATEGIES), "Strategy and planning.STRATEGIES must name the same strategies"
PROACTIVE_MODES = tuple(mode.value for mode in ProactiveMode)


@dataclass(frozen=True, slots=True)
class Policy:
    """How one request's KV moves.

    proactive: "all" pushes every block during prefill (full transfer); "floor" only layers
    0-1 (partial transfer); "budget" layers 0-1 plus the top K_r blocks by `strategy`.
    parallel: fetch remote entries while gathering local ones (else remote, then local).
    speculative: push the next slice of unsent blocks on every idle notice.
    wait_for_all: decoding starts only when every block is local (full transfer).
    drop_remote: entries not sent proactively are never fetched and never attended (proactive-only).
    quantize_bits: with "all", each layer crosses the link quantized to this many bits (KIVI/HACK-like,
    `engine.kv_quant.SERVING_QUANT`) and is dequantized on the decode node: lossy; 0 = exact.
    hints: with speculation, each decode step also ranks (1 + hints) x the selection budget, and the remote
    (token, KV head) entries past the budget are pushed next, ahead of the speculative order: what the selector is about to
    pick, on its way before it is picked. 0 = off. Never changes what a step attends to.
    prefetch: while layer l computes, layer l+1's selection is speculated from layer l's attention input
    (InfiniGen's query speculation, any query-based selector) and its remote entries are fetched; layer l+1
    then selects with its own query as always and fetches only what the speculation missed. Exact.
    chain: with speculation, each speculative slice that lands is followed by the next at once, not at the next
    idle notice, so the link carries speculative bytes whenever no fetch reply wants it (fetches go first).
    forecast: right after FIRST_TOKEN the prefill node runs the first decode step as the decode node will (each
    sparse layer attends to its selector's picks) and sends that step's query per layer (FORECAST); the decode node
    selects with them and fetches the picks it lacks, and the request joins a running batch only once they are
    local: its first step's fetches never stall the others
    (alone, it starts at once and its step waits for what is in flight instead of asking layer by layer). Exact:
    the step still selects with its own query and fetches whatever the forecast missed.
    second_token: with the forecast, the forecast step's own output is the request's second token: the prefill node
    sends it (greedy) with the first token's K/V in the FORECAST, the decode node streams it at once, adds that K/V
    to the pool and decodes from the third token on. The second token then waits for one decode step on the prefill
    node (already run for the forecast), not for the link. The prefill node runs the step after it too and sends its
    queries (a second FORECAST): a joining request fetches those picks, its own first step's, before it joins; one
    alone fetches step one's at once and starts. A request that samples (temperature > 0) or keeps its logits
    ignores it and decodes its second token itself. Same answers: the forecast steps attend as the decode node's.
    head_start: with the second token, a greedy request's prefill node keeps decoding it while it has nothing else to
    prefill and some of the request's KV has not left yet: each step attends to its whole local KV as the decode
    node's step would (the same selector), and its token goes out at once with the K/V of the token it ran on
    (FORECAST step 3). The decode node streams those tokens, adds their K/V to the pool, and takes over once the
    prefill node stops (its step-2 FORECAST marks the end): when the KV has all left, another request waits for
    prefill, or the request's tokens run out. A lone request's tokens then come at an all-local step's pace while its
    cache crosses the link, instead of each step waiting for its picks. Same answers.
    defer_proactive: with the head start and a scheduled link, a request its prefill node expects to decode itself
    (no other prompt waiting as its prefill starts) pushes only layers 0-1 proactively while requests handed on
    earlier still fetch over the same link: its decode node takes over only once its whole KV has landed, so its
    proactive set buys it nothing, and their speculation gets the prefill window's link instead. The blocks its
    K_r would have pushed lead its speculative order, which waits for theirs (`head_start`); a prompt arriving
    mid-prefill restores its proactive set (no head start will follow). Exact.
    attend_remote: a decode step's remote picks of a sparse layer are not fetched: the step sends its query and the
    entries to the prefill node (ATTEND), which attends to them where they are and sends back, per query head, the
    output and its softmax's max and sum; the step merges that with its attention over what is local (the
    log-sum-exp merge of split attention). A miss then costs a round trip of about a kilobyte, not its entries'
    bytes; the entries stay remote, hinted (with hints) so that speculation brings them next, and a joining request
    steps at once, its layers 0-1 and its forecast's picks attended where they are until they land. Exact up to
    float rounding.
    schedule: with speculation, the prefill node lets the request's speculative slices onto a link only while the
    pushes in flight there (every request's, proactive sets first) leave room, and requests waiting for room take
    turns (`engine.prefill.gate`): a new request's proactive set waits behind at most 20 ms of others'
    speculation, and a waiting slice is planned when it goes, without what fetches brought meanwhile. And K_r is
    planned again as the request's prefill starts, less the link time the pushes in flight there take
    (`PrefillEngine.begin_prefill`).
    """

    name: str  # the scheme: smartgen, full, partial, ...
    proactive: ProactiveMode = ProactiveMode.BUDGET
    strategy: Strategy = Strategy.PROFILE
    parallel: bool = True
    speculative: bool = True
    speculative_ratio: float = 0.1
    wait_for_all: bool = False
    drop_remote: bool = False
    quantize_bits: int = 0
    hints: float = 0.0
    prefetch: bool = False
    chain: bool = False
    forecast: bool = False
    second_token: bool = False
    head_start: bool = False
    schedule: bool = False
    defer_proactive: bool = False
    attend_remote: bool = False

    def __post_init__(self) -> None:
        if self.proactive not in PROACTIVE_MODES:
            raise ValueError(f"proactive must be one of {PROACTIVE_MODES}, got {self.proactive!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown proactive strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}")
        object.__setattr__(self, "proactive", ProactiveMode(self.proactive))  # plain strings accepted, enums kept
        object.__setattr__(self, "strategy", Strategy(self.strategy))
        if not 0 < self.speculative_ratio <= 1:
            raise ValueError(f"speculative ratio must be in (0, 1], got {self.speculative_ratio}")
        if self.hints < 0 or (self.hints and not self.speculative):
            raise ValueError(
                f"hints must be >= 0 and need speculation, got {self.hints} (speculative={self.speculative})"
            )
        if self.chain and not self.speculative:
            raise ValueError("chained speculation needs speculation")
        if self.schedule and not self.speculative:
            raise ValueError("scheduling speculation on the link needs speculation")
        if self.prefetch and self.drop_remote:
            raise ValueError("a policy that drops remote entries fetches nothing, so it cannot prefetch")
        if self.forecast and (self.drop_remote or self.wait_for_all):
            raise ValueError("a forecast's picks are fetched: a policy that fetches nothing cannot forecast")
        if self.second_token and not self.forecast:
            raise ValueError("the second token comes from the forecast step: second_token needs forecast")
        if self.head_start and not self.second_token:
            raise ValueError("the prefill node decodes on from the second token: head_start needs second_token")
        if self.defer_proactive and not (self.head_start and self.schedule):
            raise ValueError("deferring a proactive set to a head start needs head_start and schedule")
        if self.attend_remote and (self.drop_remote or self.wait_for_all):
            raise ValueError("attending to remote entries in place needs a policy that attends to remote entries")
        if self.drop_remote and self.speculative:
            raise ValueError("a policy that drops remote entries cannot also push them speculatively")
        if self.quantize_bits and not (self.proactive == ProactiveMode.ALL and self.wait_for_all):
            raise ValueError("only full transfer can be quantized: a quantized layer lands whole or not at all")

    def with_strategy(self, strategy: str) -> Policy:
        """The same scheme with another proactive-set strategy (random, sequential, streaming, ...)."""
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown proactive strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
        return replace(self, strategy=Strategy(strategy))

    @property
    def label(self) -> str:
        """The scheme's name, with its strategy when that is not the scheme's default: "smartgen[streaming]"."""
        default = POLICIES.get(self.name)
        if default is None or default.strategy == self.strategy or self.proactive != ProactiveMode.BUDGET:
            return self.name
        return f"{self.name}[{self.strategy.value}]"


SMARTGEN = Policy(
    "smartgen",
    proactive=ProactiveMode.BUDGET,
    parallel=True,
    speculative=True,
    hints=0.5,
    prefetch=True,
    chain=True,
    forecast=True,
    second_token=True,
    head_start=True,
    schedule=True,
    defer_proactive=True,
)

POLICIES: dict[str, Policy] = {
    policy.name: policy
    for policy in (
        Policy("full", proactive=ProactiveMode.ALL, parallel=False, speculative=False, wait_for_all=True),
        Policy("partial", proactive=ProactiveMode.FLOOR, parallel=False, speculative=False),
        Policy("partial+profile", proactive=ProactiveMode.BUDGET, parallel=False, speculative=False),
        Policy("partial+profile+parallel", proactive=ProactiveMode.BUDGET, parallel=True, speculative=False),
        # the paper's SmartGen: its three paths (proactive push, parallel fetch, speculative push)
        Policy("smartgen-paper", proactive=ProactiveMode.BUDGET, parallel=True, speculative=True),
        Policy("smartgen-paper+hints", proactive=ProactiveMode.BUDGET, parallel=True, speculative=True, hints=0.5),
        # ours, the default: the paper's paths with hints, prefetch, chained speculation (docs/results/2026-12-01-separate-cpus-8bit-bounds.md: better
        # TBT, same TTST), the first step's forecast and speculation scheduled on the link (docs/engine.md)
        SMARTGEN,
        # the ablations, one part left out each
        replace(
            SMARTGEN,
            name="smartgen-no-forecast",
            forecast=False,
            second_token=False,
            head_start=False,
            defer_proactive=False,
        ),
        replace(SMARTGEN, name="smartgen-no-second-token", second_token=False, head_start=False, defer_proactive=False),
        replace(SMARTGEN, name="smartgen-no-head-start", head_start=False, defer_proactive=False),
        replace(SMARTGEN, name="smartgen-eager-proactive", defer_proactive=False),
        replace(SMARTGEN, name="smartgen-unscheduled", schedule=False, defer_proactive=False),
        replace(SMARTGEN, name="smartgen-no-prefetch", prefetch=False),
        replace(SMARTGEN, name="smartgen-no-hints", hints=0.0),
        # a step's remote picks attended on the prefill node instead of fetched (docs/results/2026-12-08-*)
        # (no prefetch: a miss costs a round trip, and a prefetch's reply would hold up the replies steps wait for)
        replace(SMARTGEN, name="smartgen-attend", attend_remote=True, prefetch=False),
        Policy("proactive-only", proactive=ProactiveMode.BUDGET, parallel=True, speculative=False, drop_remote=True),
        Policy(
            "quant2", proactive=ProactiveMode.ALL, parallel=False, speculative=False, wait_for_all=True, quantize_bits=2
        ),
    )
}


def get_policy(name: str, strategy: str | None = None, speculative_ratio: float | None = None) -> Policy:
    """Looks a policy up by name or label ("smartgen[streaming]"), optionally with another strategy or speculative
    ratio."""
    name, label_strategy = split_label(name)
    strategy = strategy or label_strategy
    try:
        policy = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheme {name!r}; choose one of {', '.join(POLICIES)}") from None
    if strategy is not None and strategy != policy.strategy:
        policy = policy.with_strategy(strategy)
    if speculative_ratio is not None:
        policy = replace(policy, speculative_ratio=speculative_ratio)
    return policy


def split_label(label: str) -> tuple[str, str | None]:
    """A policy label's scheme and strategy: "smartgen[random]" -> ("smartgen", "random"), "full" -> ("full", None)."""
    if label.endswith("]") and "[" in label:
        name, _, strategy = label[:-1].partition("[")
        return name, strategy
    return label, None


def check_quantizable(policy: Policy, head_dim: int) -> Policy:
    """`policy`, if its KV can cross the link at its bits for this head size (every unquantized scheme can); a
    ValueError saying why not otherwise."""
    if policy.quantize_bits:
        reason = quant_unsupported(head_dim, replace(SERVING_QUANT, bits=policy.quantize_bits))
        if reason:
            raise ValueError(f"scheme {policy.label!r} cannot run on this model: {reason}")
    return policy


def check_servable(policy: Policy, *, oracle: bool = False, head_dim: int | None = None) -> Policy:
    """`policy`, if a serving node can run it; a ValueError saying why not otherwise. The optimal proactive set is
    the blocks the request's own decode steps will select: the simulator replays them, and a serving node runs it
    only for a request that brings them (`oracle`: the selection counts of a recorded run of the same prompt,
    the API's `proactive_counts`). `head_dim`: the model's; a quantized scheme must be able to group it (the one
    scheme that depends on the head size)."""
    if head_dim is not None:
        check_quantizable(policy, head_dim)
    if policy.proactive == ProactiveMode.BUDGET and policy.strategy == Strategy.OPTIMAL and not oracle:
        raise ValueError(
            "the optimal proactive set needs the request's own future selections, which a serving node cannot "
            "know: send them as `proactive_counts` (a recorded run's usage.selection_counts, asked for with "
            "`return_selection_counts`), or run `smartgen simulate --strategy optimal`"
        )
    return policy
