"""The decode node's own CPU per decode step as the context grows, split by where it goes, against the emulated step.

    .venv/bin/python bench/context_cost.py                          # 1K, 4K, 16K, 32K; 32 layers, 8 KV heads, d 32
    .venv/bin/python bench/context_cost.py --lengths 1024 --reps 1  # one quick point

Runs `smartgen simulate`'s engine (apps/simulate.py: the real decode and prefill engines, request driver and
prefill worker over a paced in-process link, synthetic KV, compute emulated by sleeping) under one scheme, and
times with the step thread's CPU clock (time.thread_time: sleeps, lock waits and other threads do not count) every
engine call of each decode step, each counted once, in the innermost component it belongs to:

    mask      mask-table scans: is a layer / a request local, any remote left (all_local, _has_remote, spans, waits)
    split     the index split by mask and its remote-first reorder, the assembly plan, entry status (hints, prefetch)
    gather    the selected K and V copied from the pool into the assembled [B·H, k, d] tensors
    fetch     FETCH messages built and posted, and their replies landed in the pool (waits excluded)
    books     everything else the engine and the driver do in a step: idle notices, appends, selection counts,
              the assembled tensors' allocation, end of step, the driver's own loop
    listener  the decode node's link listener thread (FETCH replies, FIRST_TOKEN, ...), its CPU over the steps

The synthetic selector (the trace) and the emulated compute are the model's and are not counted. Each figure is the
median over every decode step of every repetition (ms of CPU per step); `x emul` is the total over the emulated step
(layers x --layer-ms). Pushes land through the lane's own threads, like one-sided writes: not the decode node's CPU.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import smartgen.apps.simulate as sim
import smartgen.engine.decode.decide as decide
import smartgen.engine.decode.move as move
from smartgen.apps.synthetic import SyntheticTrace
from smartgen.engine.decode import DecodeEngine
from smartgen.engine.layout import KVLayout
from smartgen.engine.mask import MaskTable
from smartgen.engine.policy import get_policy
from smartgen.engine.pool import DecodePool
from smartgen.runtime.driver import DecodeDriver

COMPONENTS = ("mask", "split", "gather", "fetch", "books", "listener")
MODEL = "model"  # the synthetic selector and the emulated compute: timed apart, never reported as overhead


class StepClock:
    """Exclusive CPU time per component on one thread: a call's time less the time of the timed calls inside it."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = dict.fromkeys((*COMPONENTS, MODEL), 0.0)
        self._stack: list[float] = []  # per open call: the CPU time its timed children took
        self._thread = threading.get_ident()
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str, component: str) -> None:
        original = getattr(owner, name)
        self._undo.append((owner, name, original))

        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self._thread:
                return original(*args, **kwargs)
            self._stack.append(0.0)
            started = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                spent = time.thread_time() - started
                inner = self._stack.pop()
                self.totals[component] += spent - inner
                if self._stack:
                    self._stack[-1] += spent

        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()


def instrument(clock: StepClock) -> None:
    """Every engine call a decode step makes, by component (module-level names are patched where move.py and
    decide.py look them up)."""
    clock.wrap(MaskTable, "all_local", "mask")
    clock.wrap(MaskTable, "spans_local", "mask")
    clock.wrap(DecodePool, "sync_staged", "mask")
    for name in ("_has_remote", "_await_pushed", "local_spans"):
        clock.wrap(DecodeEngine, name, "mask")
    for owner, name in ((move, "split_reorder"), (move, "entry_status"), (decide, "plan_assembly")):
        clock.wrap(owner, name, "split")
    clock.wrap(move, "gather_kv", "gather")
    clock.wrap(move, "gather_valid", "gather")
    for name in ("_send_fetches", "_land_fetches", "_land_late"):
        clock.wrap(DecodeEngine, name, "fetch")
    for name in (
        "assemble",
        "begin_layer",
        "append",
        "end_step",
        "count_step_selections",
        "hint_factor",
        "prefetch_wanted",
    ):
        clock.wrap(DecodeEngine, name, "books")
    clock.wrap(DecodeDriver, "step", "books")
    clock.wrap(sim._SyntheticDecode, "step", MODEL)


def memoize_trace() -> Callable[[], None]:
    """The synthetic selector's picks are deterministic in their arguments; repetitions reuse them (a 32K pick
    takes ~0.2 s of the model's time, not the engine's). Returns the undo."""
    original = SyntheticTrace.select
    memo: dict[tuple, torch.Tensor] = {}

    def select(self: SyntheticTrace, layer: int, length: int, context: int, seed: int) -> torch.Tensor:
        key = (self, layer, length, context, seed)
        if key not in memo:
            memo[key] = original(self, layer, length, context, seed)
        return memo[key]

    SyntheticTrace.select = select  # type: ignore[method-assign]
    return lambda: setattr(SyntheticTrace, "select", original)


def thread_cpu(name: str) -> float:
    """CPU seconds of the live thread called `name` (0 when none)."""
    for thread in threading.enumerate():
        if thread.name == name and thread.ident is not None:
            return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return 0.0


def run_once(
    config: sim.SimulationConfig, scheme: str, importance: torch.Tensor
) -> tuple[list[dict[str, float]], float]:
    """One simulated request: the CPU of each decode step by component (ms), and its on-demand ratio."""
    clock = StepClock()
    steps: list[dict[str, float]] = []
    last_totals, last_listener = dict(clock.totals), 0.0

    def on_step(step: int) -> None:
        nonlocal last_totals, last_listener
        listener = thread_cpu("decode-listen")
        row = {c: (clock.totals[c] - last_totals[c]) * 1e3 for c in (*COMPONENTS, MODEL) if c != "listener"}
        # the listener's clock starts with its thread: its first reading covers the prefill too, so step 1 has none
        row["listener"] = (listener - last_listener) * 1e3 if step > 1 else float("nan")
        steps.append(row)
        last_totals, last_listener = dict(clock.totals), listener

    instrument(clock)
    try:
        result = sim.simulate(config, get_policy(scheme), importance, on_step=on_step)
    finally:
        clock.restore()
    return steps, result.on_demand_ratio


def median(rows: list[dict[str, float]], key: str) -> float:
    values = [row[key] for row in rows if row[key] == row[key]]  # NaN (no reading) left out
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096,16384,32768", help="context lengths, comma-separated")
    parser.add_argument("--layers", type=int, default=32, help="attention layers")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads (8 like Llama-3-8B)")
    parser.add_argument("--head-dim", type=int, default=32, help="head dimension (Llama-3-8B's 128 needs 4x the RAM)")
    parser.add_argument("--scheme", default="smartgen", help="transfer scheme (policy name)")
    parser.add_argument("--select-ratio", type=float, default=0.1, help="share of tokens selected per head and step")
    parser.add_argument("--steps", type=int, default=8, help="output tokens per request (decode steps + 1)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per length (medians over all their steps)")
    parser.add_argument("--layer-ms", type=float, default=1.0, help="emulated decode compute per layer (ms)")
    parser.add_argument("--prefill-us", type=float, default=30.0, help="emulated prefill compute per token (us)")
    parser.add_argument("--stall-ratio", type=float, default=4.7, help="full transfer / prefill time: sets the link")
    parser.add_argument("--batch", type=int, default=1, help="requests decoding together (each of every length)")
    parser.add_argument("--skip-first", action="store_true", help="leave the first decode step (its fetches) out")
    args = parser.parse_args()
    if args.batch < 1:
        parser.error(f"--batch must be at least 1, got {args.batch}")
    torch.set_num_threads(1)  # one decode node's step thread; the machine is shared
    layout = KVLayout(args.layers, args.kv_heads, args.head_dim, torch.float16, num_blocks=1024)
    emulated_ms = args.layers * args.layer_ms
    print(
        f"{args.scheme}: L={args.layers} H={args.kv_heads} d={args.head_dim} fp16, {args.select_ratio:.0%} selected, "
        f"stall ratio {args.stall_ratio}, emulated step {emulated_ms:g} ms, {args.steps - 1} decode steps x "
        f"{args.reps} reps, batch {args.batch}; ms of CPU per step (median)"
    )
    header = f"{'context':>8} {'link Gb/s':>9} " + " ".join(f"{c:>8}" for c in COMPONENTS)
    print(header + f" {'total':>8} {'x emul':>7} {'no gath':>8} {'od%':>5}")
    undo = memoize_trace()
    try:
        for length in (int(x) for x in args.lengths.split(",")):
            config = sim.SimulationConfig(
                layout,
                lengths=(length,) * args.batch,
                steps=args.steps,
                select_ratio=args.select_ratio,
                prefill_seconds_per_token=args.prefill_us * 1e-6,
                decode_layer_seconds=args.layer_ms * 1e-3,
                verify=False,
                calibration_prompts=2,
                calibration_steps=2,
                drain_speculation=False,
            )
            gbps = sim.link_rate_for(config, args.stall_ratio)
            config = sim.SimulationConfig(**{**{f: getattr(config, f) for f in config.__slots__}, "gbps": gbps})
            importance = sim.calibrate(config, SyntheticTrace(args.layers, args.kv_heads, ratio=args.select_ratio))
            rows: list[dict[str, float]] = []
            ratios = []
            for _ in range(args.reps):
                steps, on_demand = run_once(config, args.scheme, importance)
                rows += steps[1:] if args.skip_first else steps
                ratios.append(on_demand)
            for row in rows:
                row["total"] = sum(v for c, v in row.items() if c in COMPONENTS and v == v)
                row["no_gather"] = row["total"] - row["gather"]
            total = median(rows, "total")
            cells = " ".join(f"{median(rows, c):>8.2f}" for c in COMPONENTS)
            print(
                f"{length:>8} {gbps:>9.2f} {cells} {total:>8.2f} {total / emulated_ms:>7.3f} "
                f"{median(rows, 'no_gather'):>8.2f} {statistics.median(ratios):>5.1%}",
                flush=True,
            )
    finally:
        undo()


if __name__ == "__main__":
    main()
