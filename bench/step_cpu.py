"""The decode step's own CPU by batch size, with every KV entry local (full transfer's steps) or most still remote.

    .venv/bin/python bench/step_cpu.py                                  # random:32's weights, 2K tokens, Quest 10%
    .venv/bin/python bench/step_cpu.py --model samples/sample-model-16 --batch 1,4
    .venv/bin/python bench/step_cpu.py --remote --batch 2 --profile     # SmartGen's early steps, and where they go

Each case opens `--batch` prompts of `--length` random tokens in an in-process pipeline, takes one warm-up step,
then times `--steps` decode steps with the step thread's CPU clock (`time.thread_time`: sleeps, link waits and
other threads do not count, so a busy machine moves the figures less than wall time would). Prints the median per
case. The model's forward, the selector, the split, the gathers and the bookkeeping all count; nothing is emulated.

By default the scheme is full transfer, so every entry is local before decoding starts. With `--remote` it is
`smartgen-no-forecast` with a streaming proactive set (no forecast, no head start: every timed step is the decode
node's own) on a link paced at `--mbps`, so the steps meet entries still remote: they split by the mask, fetch,
land and gather what they fetched, hint and send notices; the share of selected entries that were remote is
printed beside each case. `--profile` prints the step thread's busiest functions over the timed steps, timed by its
own CPU clock, so waits for fetch replies are not charged to whoever waited (cProfile inflates each call, the more
the smaller it is, and in one process both nodes' threads share the interpreter: read the shares, not the ms).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

import torch

from smartgen.apps.bench.models import resolve_model
from smartgen.engine.policy import get_policy
from smartgen.runtime.models import load_model
from smartgen.runtime.pipeline import InprocPipeline

REMOTE_SCHEME = "smartgen-no-forecast"


def step_cpu_ms(
    model,
    batch: int,
    length: int,
    steps: int,
    budget: float,
    *,
    remote_mbps: float | None = None,
    profile: cProfile.Profile | None = None,
) -> tuple[float, float]:
    """(median CPU ms of the step thread per decode step, share of the selected entries that were remote) over
    `steps` steps of `batch` requests: all local (full transfer), or with `remote_mbps` crossing a link paced at it
    under `REMOTE_SCHEME`."""
    if remote_mbps is None:
        policy, paced = get_policy("full"), {}
    else:
        # a streaming proactive set sizes itself from prefill time: any positive value will do for a timing run
        policy, paced = (
            get_policy(REMOTE_SCHEME, strategy="streaming"),
            {
                "gbps": remote_mbps / 1000,
                "prefill_seconds_per_token": 1e-4,
            },
        )
    with InprocPipeline(
        model,
        policy,
        "quest",
        {"budget": budget},
        max_batch=batch,
        max_tokens=length + steps + 8,
        num_blocks=max(1024, batch * (length + steps + 8) // 16 + 64),
        **paced,
    ) as pipeline:
        prompts = [torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(i)) for i in range(batch)]
        running, _ = pipeline.prepare(prompts, max_new_tokens=steps + 4)
        engine = pipeline.decode_engine

        def step() -> None:
            tokens, _ = pipeline.decode_runner.step(running)
            engine.end_step(running.request_ids)
            running.advance(tokens)

        def counts() -> tuple[int, int]:
            metrics = [engine.metrics(rid) for rid in running.request_ids]
            return sum(m.selected_entries for m in metrics), sum(m.remote_entries for m in metrics)

        step()
        selected0, remote0 = counts()
        samples = []
        for _ in range(steps):
            started = time.thread_time()
            if profile is not None:
                profile.enable()
            step()
            if profile is not None:
                profile.disable()
            samples.append(time.thread_time() - started)
        selected, remote = counts()
        pipeline.release(running.request_ids)
    return statistics.median(samples) * 1e3, (remote - remote0) / max(1, selected - selected0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:32", help="a model folder, sample, sample16 or random:LAYERS")
    parser.add_argument("--batch", default="1,2,4", help="batch sizes, comma-separated")
    parser.add_argument("--length", type=int, default=2048, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=12, help="timed decode steps per case (median reported)")
    parser.add_argument("--budget", type=float, default=0.1, help="Quest token budget as a share of the prompt")
    parser.add_argument("--reps", type=int, default=1, help="times each case is run, in turn")
    parser.add_argument("--remote", action="store_true", help=f"{REMOTE_SCHEME} over a paced link, not all local")
    parser.add_argument("--mbps", type=float, default=30.0, help="with --remote: the link's rate, Mbit/s")
    parser.add_argument("--profile", action="store_true", help="print the step thread's busiest functions")
    parser.add_argument("--sort", default="tottime", help="with --profile: a pstats sort key (tottime, cumulative)")
    parser.add_argument("--top", type=int, default=30, help="with --profile: how many functions to print")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)  # as a served node on its one CPU
    try:
        sizes = [int(b) for b in args.batch.split(",")]
        if min(sizes) < 1 or args.length < 2 or args.steps < 1 or args.reps < 1 or not 0 < args.budget <= 1:
            raise ValueError("--batch, --length, --steps and --reps must be positive, --budget in (0, 1]")
        if args.mbps <= 0 or args.top < 1:
            raise ValueError("--mbps and --top must be positive")
        folder, _ = resolve_model(args.model)
    except ValueError as exc:  # a typo in an option is the user's to fix, not a traceback
        parser.error(str(exc))
    model = load_model(Path(folder))
    # the step thread's own CPU clock: waits for fetch replies and the other node's threads do not count
    profile = cProfile.Profile(time.thread_time) if args.profile else None
    where = f"{REMOTE_SCHEME} over a {args.mbps:g} Mbit/s link (remote: share of picks)" if args.remote else "all local"
    print(f"{args.model}: {args.length} tokens, Quest {args.budget:g}, {where}; ms of the step thread's CPU per step")
    print(f"{'batch':>6} " + " ".join(f"{'rep ' + str(r + 1):>15}" for r in range(args.reps)))
    results: dict[int, list[tuple[float, float]]] = {b: [] for b in sizes}
    mbps = args.mbps if args.remote else None
    for _ in range(args.reps):
        for b in sizes:
            results[b].append(
                step_cpu_ms(model, b, args.length, args.steps, args.budget, remote_mbps=mbps, profile=profile)
            )
    for b in sizes:
        cells = [f"{ms:>8.1f} ({share:>4.0%})" if args.remote else f"{ms:>15.1f}" for ms, share in results[b]]
        print(f"{b:>6} " + " ".join(cells))
    if profile is not None:
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(args.sort).print_stats(args.top)
        print(out.getvalue())


if __name__ == "__main__":
    main()
