"""Counters the monitor, the benchmarks and Prometheus read: bytes and time per path, on-demand ratio, request state."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from smartgen.engine.layout import DENSE_LAYERS

if TYPE_CHECKING:
    import torch

__all__ = ["PATHS", "FETCH_KINDS", "STEP_FIELDS", "RequestState", "RequestMetrics", "PathCounters"]

# "full" is what a full-transfer request pushes during prefill (counted apart from SmartGen's proactive set)
PATHS = ("proactive", "full", "on_demand", "speculative", "local", "metadata")
# a decode node's fetches: a step's own (on its critical path), a look-ahead prefetch of the next layer, and a
# forecast's (a joining request's first step, asked at low priority before it runs)
FETCH_KINDS = ("step", "prefetch", "forecast")
# a decode node's steps by batch size (`PathCounters.add_step`): how many, their summed seconds of each part, and how
# many times the step thread was preempted (another thread took its CPU as it woke)
STEP_FIELDS = ("steps", "wall_s", "cpu_s", "emulated_s", "wait_s", "preempted")


class RequestState(str, Enum):
    """Where a request is in its life on the decode node (see smartgen.engine.decode)."""

    ADMITTED = "admitted"
    DISPATCHED = "dispatched"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FULLY_LOCAL = "fully_local"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(slots=True)
class RequestMetrics:
    """One request's timeline and transfer counts."""

    request_id: str
    prompt_tokens: int
    state: RequestState = RequestState.ADMITTED
    created: float = field(default_factory=time.monotonic)
    token_times: list[float] = field(default_factory=list)  # monotonic arrival of each output token
    selected_entries: int = 0
    remote_entries: int = 0
    fetched_tokens: int = 0
    prefetched_entries: int = 0  # (token, head) entries fetched ahead on a speculated selection (prefetch policy)
    held_tokens: int = 0  # leading prompt tokens the decode node's prefix cache supplied (never transferred)
    prefill_cached_tokens: int = 0  # leading prompt tokens the prefill node's prefix cache supplied (not computed)
    fully_local_at: float | None = None
    error: str | None = None
    # output tokens the prefill node computed: 1, or 2 when the forecast step's token was the second
    # (Policy.second_token); the decode node's first step is the one after them
    prefill_tokens: int = 1
    # the decode node's first step (token 2, or 3 after a second token from the prefill node): how much of its
    # selection was already local, and how long it waited for the rest; over all steps, the time spent waiting for
    # fetches (what TTST and TBT pay for the link)
    first_step_selected: int = 0
    first_step_remote: int = 0
    first_step_wait_s: float = 0.0
    # of those, entries the step had to ask for itself: neither local nor asked ahead (a forecast's fetches)
    first_step_unforeseen: int = 0
    forecast_entries: int = 0  # entries a forecast asked for before the first step (Policy.forecast)
    # entries decode steps fetched for themselves (not forecasts, not prefetches), and how many of those an earlier
    # idle notice had hinted: hints the speculative push had not brought in time
    step_fetched: int = 0
    step_fetched_hinted: int = 0
    step_attended: int = 0  # entries decode steps had attended where they are instead (Policy.attend_remote)
    # steps taken back and redone: a fetch past the stall bound (`--fetch-stall-ms`) or its share (`--step-share`)
    deferred_steps: int = 0
    fetch_wait_s: float = 0.0
    # bytes of the distinct (layer >= 2, token, head) entries selected so far, and that figure as each token
    # arrived: what the link had to have carried by then (the benchmark's CTL bound)
    selected_union_bytes: int = 0
    union_bytes_at_token: list[int] = field(default_factory=list)
    # [L, n, H] int32: how many steps selected each (layer >= 2, token, KV head) entry: after the fact, the
    # request's own "optimal" proactive set (the benchmark replays it with `proactive_counts`)
    selection_counts: torch.Tensor | None = None
    # when the request passed each point of its life on the decode node (monotonic, the first time only):
    # "dense_local" (layers 0-1 local), "forecast_asked", "forecast_landed", "joined" (the running batch),
    # "fully_local" (as `fully_local_at`): the
    # benchmark's per-request timeline, which says what a joining request waited for
    milestones: dict[str, float] = field(default_factory=dict)
    # seconds each token's step waited for the link (0 for the prefill node's tokens), in token order
    token_waits: list[float] = field(default_factory=list)
    _step_wait: float = 0.0

    @property
    def in_first_step(self) -> bool:
        """Whether the step under way is the decode node's first (only the prefill node's tokens so far)."""
        return len(self.token_times) == self.prefill_tokens

    def count_selection(self, selected: int, remote: int, layer: int, dropped: int = 0) -> None:
        """`selected` entries attended, `remote` of them fetched; `dropped`: selected but remote and never
        attended (proactive-only), which count against the first step's coverage only."""
        self.selected_entries += selected
        self.remote_entries += remote
        # the first step's coverage is over the selecting layers: layers 0-1 are dense and always awaited whole,
        # and counted in they made a transfer that covered nothing above them read 59% (16 layers, 10% budget)
        if self.in_first_step and layer >= DENSE_LAYERS:
            self.first_step_selected += selected + dropped
            self.first_step_remote += remote + dropped

    def count_new_selection(self, entry_bytes: int) -> None:
        """Entries selected for the first time in this request, `entry_bytes` of K and V in all."""
        self.selected_union_bytes += entry_bytes

    def record_token(self, at: float) -> None:
        """A token arrived at monotonic time `at`."""
        self.token_times.append(at)
        self.union_bytes_at_token.append(self.selected_union_bytes)
        self.token_waits.append(self._step_wait)
        self._step_wait = 0.0

    def mark(self, milestone: str, at: float | None = None) -> None:
        """The request reached `milestone` (see `milestones`) now or at `at`; later calls keep the first time."""
        self.milestones.setdefault(milestone, time.monotonic() if at is None else at)

    def timeline(self) -> dict[str, float]:
        """The milestones in seconds from the request's arrival, in the order they came."""
        return {name: at - self.created for name, at in sorted(self.milestones.items(), key=lambda item: item[1])}

    def count_fetch_wait(self, seconds: float) -> None:
        self.fetch_wait_s += seconds
        self._step_wait += seconds
        if self.in_first_step:
            self.first_step_wait_s += seconds

    @property
    def first_step_coverage(self) -> float | None:
        """Share of the first decode step's selected entries in layers >= 2 that were local when it ran (None
        before it ran)."""
        if not self.first_step_selected:
            return None
        return 1.0 - self.first_step_remote / self.first_step_selected

    @property
    def first_step_foreseen(self) -> float | None:
        """Share of the first decode step's selected entries in layers >= 2 that were local or already on their way
        when it selected them (a forecast's fetches): what the prediction of step one covered (None before it ran)."""
        if not self.first_step_selected:
            return None
        return 1.0 - self.first_step_unforeseen / self.first_step_selected

    @property
    def ttft(self) -> float | None:
        """Time to first token, from the request's arrival."""
        return self.token_times[0] - self.created if self.token_times else None

    @property
    def ttst(self) -> float | None:
        """Time to second token (the first decoded one), from the request's arrival."""
        return self.token_times[1] - self.created if len(self.token_times) > 1 else None

    @property
    def tbt(self) -> float | None:
        """Mean time between tokens after the second one."""
        times = self.token_times[1:]
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None

    @property
    def ctl(self) -> list[float]:
        """Cumulative token latency: when token t arrived, counted from the request's arrival (t = 0, 1, ...).

        TTFT is ctl[0], TTST ctl[1]; a scheme's CTL curve (the paper's Figure 9) is the mean of
        these over requests, token by token.
        """
        return [t - self.created for t in self.token_times]

    @property
    def on_demand_ratio(self) -> float:
        return self.remote_entries / self.selected_entries if self.selected_entries else 0.0

    def snapshot(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "state": self.state.value,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": len(self.token_times),
            "ttft": self.ttft,
            "ttst": self.ttst,
            "tbt": self.tbt,
            "on_demand_ratio": self.on_demand_ratio,
            "fetched_tokens": self.fetched_tokens,
            "prefetched_entries": self.prefetched_entries,
            "held_tokens": self.held_tokens,
            "prefill_cached_tokens": self.prefill_cached_tokens,
            "selected_entries": self.selected_entries,
            "remote_entries": self.remote_entries,
            "first_step_coverage": self.first_step_coverage,
            "first_step_wait_s": self.first_step_wait_s,
            "first_step_foreseen": self.first_step_foreseen,
            "forecast_entries": self.forecast_entries,
            "step_fetched": self.step_fetched,
            "step_fetched_hinted": self.step_fetched_hinted,
            "step_attended": self.step_attended,
            "deferred_steps": self.deferred_steps,
            "prefill_tokens": self.prefill_tokens,
            "fetch_wait_s": self.fetch_wait_s,
            "selected_union_bytes": self.selected_union_bytes,
            "error": self.error,
        }


# why a request's decode step was taken back: its fetches held the batch past its share of the step (it stays in the
# batch, `--step-share`), or a fetch stalled past `--fetch-stall-ms` (it parks until the fetch lands)
DEFERRAL_REASONS = ("share", "stall")


class PathCounters:
    """Bytes, seconds and transfers per path, failed transfers, selected/remote entry counts (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)
        self.transfers: dict[str, int] = defaultdict(int)
        self.failed: dict[str, int] = defaultdict(int)
        self.selected_entries = 0
        self.remote_entries = 0
        # decode steps taken back and redone, by why (DEFERRAL_REASONS): held back for its share, or a stalled fetch
        self.deferred: dict[str, int] = defaultdict(int)
        # fetch replies landed by kind (FETCH_KINDS): how many, and their summed time from sending to the reply's
        # arrival
        self.fetch_landed: dict[str, int] = defaultdict(int)
        self.fetch_seconds: dict[str, float] = defaultdict(float)
        # decode steps' waits for fetch replies by the kind of reply waited for (a step's own, a prefetch's, a
        # forecast's): where a step's link waits go
        self.fetch_waited: dict[str, float] = defaultdict(float)
        # decode steps by batch size: [steps, wall, the step thread's CPU, emulated compute, link waits] (seconds)
        self.steps: dict[int, list[float]] = {}
        self._observers: list[Callable[[str, int, float], None]] = []

    def observe(self, callback: Callable[[str, int, float], None]) -> None:
        """Calls `callback(path, num_bytes, seconds)` after every `add` (Prometheus histograms hang here)."""
        self._observers.append(callback)

    def add(self, path: str, num_bytes: int = 0, seconds: float = 0.0) -> None:
        with self._lock:
            self.bytes[path] += num_bytes
            self.seconds[path] += seconds
            self.transfers[path] += 1
        for callback in self._observers:
            callback(path, num_bytes, seconds)

    def add_time(self, path: str, seconds: float) -> None:
        """Time a transfer already counted by `add` took to complete (a push batch, from posting to applied)."""
        with self._lock:
            self.seconds[path] += seconds

    def add_failure(self, path: str) -> None:
        """A transfer on `path` that did not complete (timed out, malformed reply, link lost)."""
        with self._lock:
            self.failed[path] += 1

    def add_deferral(self, reason: str) -> None:
        """A request's decode step was taken back, to be redone (`reason`: one of DEFERRAL_REASONS)."""
        with self._lock:
            self.deferred[reason] += 1

    def add_fetch(self, kind: str, seconds: float) -> None:
        """A fetch reply of `kind` arrived `seconds` after its FETCH was sent (and has landed)."""
        with self._lock:
            self.fetch_landed[kind] += 1
            self.fetch_seconds[kind] += seconds

    def add_fetch_wait(self, kind: str, seconds: float) -> None:
        """A decode step waited `seconds` for a fetch reply of `kind` (one that arrived then, or the first still
        out when the wait ended without one)."""
        with self._lock:
            self.fetch_waited[kind] += seconds

    def add_step(
        self, batch: int, wall_s: float, cpu_s: float, emulated_s: float, wait_s: float, preempted: int = 0
    ) -> None:
        """One decode step of `batch` requests: its wall time, the step thread's own CPU, the emulated compute it
        slept (benchmarks) and its waits for the link (fetch replies, layers 0-1); the rest of the wall is the step
        thread runnable but not running (other threads of the node on its CPU, the GIL). `preempted`: the times
        another thread took the step thread's CPU during the step (its involuntary context switches)."""
        with self._lock:
            row = self.steps.setdefault(batch, [0, 0.0, 0.0, 0.0, 0.0, 0])
            for i, value in enumerate((1, wall_s, cpu_s, emulated_s, wait_s, preempted)):
                row[i] += value

    def add_selection(self, selected: int, remote: int) -> None:
        with self._lock:
            self.selected_entries += selected
            self.remote_entries += remote

    @property
    def on_demand_ratio(self) -> float:
        with self._lock:
            return self.remote_entries / self.selected_entries if self.selected_entries else 0.0

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "bytes": {p: self.bytes.get(p, 0) for p in PATHS},
                "seconds": {p: self.seconds.get(p, 0.0) for p in PATHS},
                "transfers": {p: self.transfers.get(p, 0) for p in PATHS},
                "failed": {p: self.failed.get(p, 0) for p in PATHS},
                "selected_entries": self.selected_entries,
                "remote_entries": self.remote_entries,
                "on_demand_ratio": self.remote_entries / self.selected_entries if self.selected_entries else 0.0,
                "deferred_steps": {reason: self.deferred.get(reason, 0) for reason in DEFERRAL_REASONS},
                "fetches": {
                    kind: {
                        "landed": self.fetch_landed.get(kind, 0),
                        "seconds": self.fetch_seconds.get(kind, 0.0),
                        "waited": self.fetch_waited.get(kind, 0.0),
                    }
                    for kind in FETCH_KINDS
                },
                "steps": {str(batch): dict(zip(STEP_FIELDS, row)) for batch, row in sorted(self.steps.items())},
            }
