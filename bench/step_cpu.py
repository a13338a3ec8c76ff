"""The decode step's own CPU with every KV entry local (full transfer's steps), by batch size, for one model.

    .venv/bin/python bench/step_cpu.py                                  # random:32's weights, 2K tokens, Quest 10%
    .venv/bin/python bench/step_cpu.py --model samples/sample-model-16 --batch 1,4

Each case opens `--batch` prompts of `--length` random tokens in an in-process pipeline under full transfer (so
every entry is local before decoding starts), takes one warm-up step, then times `--steps` decode steps with the
step thread's CPU clock (`time.thread_time`: sleeps and other threads do not count, so a busy machine moves the
figures less than wall time would). Prints the median per case. The model's forward, the selector, the split,
the gathers and the bookkeeping all count; nothing is emulated.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from smartgen.apps.bench.models import resolve_model
from smartgen.engine.policy import get_policy
from smartgen.runtime.models import load_model
from smartgen.runtime.pipeline import InprocPipeline


def step_cpu_ms(model, batch: int, length: int, steps: int, budget: float) -> float:
    """Median CPU (ms) of the step thread per decode step of `batch` all-local requests of `length` tokens."""
    with InprocPipeline(
        model,
        get_policy("full"),
        "quest",
        {"budget": budget},
        max_batch=batch,
        max_tokens=length + steps + 8,
        num_blocks=max(1024, batch * (length + steps + 8) // 16 + 64),
    ) as pipeline:
        prompts = [torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(i)) for i in range(batch)]
        running, _ = pipeline.prepare(prompts, max_new_tokens=steps + 4)

        def step() -> None:
            tokens, _ = pipeline.decode_runner.step(running)
            running.advance(tokens)

        step()
        samples = []
        for _ in range(steps):
            started = time.thread_time()
            step()
            samples.append(time.thread_time() - started)
        pipeline.release(running.request_ids)
    return statistics.median(samples) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:32", help="a model folder, sample, sample16 or random:LAYERS")
    parser.add_argument("--batch", default="1,2,4", help="batch sizes, comma-separated")
    parser.add_argument("--length", type=int, default=2048, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=12, help="timed decode steps per case (median reported)")
    parser.add_argument("--budget", type=float, default=0.1, help="Quest token budget as a share of the prompt")
    parser.add_argument("--reps", type=int, default=1, help="times each case is run, in turn")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)  # as a served node on its one CPU
    try:
        sizes = [int(b) for b in args.batch.split(",")]
        if min(sizes) < 1 or args.length < 2 or args.steps < 1 or args.reps < 1 or not 0 < args.budget <= 1:
            raise ValueError("--batch, --length, --steps and --reps must be positive, --budget in (0, 1]")
        folder, _ = resolve_model(args.model)
    except ValueError as exc:  # a typo in an option is the user's to fix, not a traceback
        parser.error(str(exc))
    model = load_model(Path(folder))
    print(f"{args.model}: {args.length} tokens, Quest {args.budget:g}, all local; ms of the step thread's CPU per step")
    print(f"{'batch':>6} " + " ".join(f"{'rep ' + str(r + 1):>8}" for r in range(args.reps)))
    results = {b: [] for b in sizes}
    for _ in range(args.reps):
        for b in sizes:
            results[b].append(step_cpu_ms(model, b, args.length, args.steps, args.budget))
    for b in sizes:
        print(f"{b:>6} " + " ".join(f"{ms:>8.1f}" for ms in results[b]))


if __name__ == "__main__":
    main()
