"""One layer's selection time by batch size: what a decode step's selector costs the step thread.

    .venv/bin/python bench/selector_cost.py                        # Quest 10%, the sample's shape, 2K, batch 1-8
    .venv/bin/python bench/selector_cost.py --length 8192 --kv-heads 8 --q-heads 32 --head-dim 128

Times `select` and `select_with_next` (the step's own pick with what the hints' wider one adds, as `smartgen`
runs it every sparse layer; a prefetch runs one more `select` on a speculated query) on random prompts and queries,
8-bit page bounds as the prefill node ships them. The minimum over --rounds rounds of --calls calls each, in µs a
call, and per batch member. One thread: a decode node's step runs on one.
"""

from __future__ import annotations

import argparse
import time

import torch

from smartgen.selectors.base import ModelInfo, PrefillLayer, StepQuery
from smartgen.selectors.quest import QuestSelector


def _best_us(fn, calls: int, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - started) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048, help="prompt tokens of every request")
    parser.add_argument("--batches", default="1,2,4,8", help="batch sizes, comma-separated")
    parser.add_argument("--budget", type=float, default=0.1, help="Quest's token budget (share of the prompt)")
    parser.add_argument("--hints", type=float, default=0.5, help="the wider pick's extra budget (smartgen: 0.5)")
    parser.add_argument("--kv-heads", type=int, default=2, help="KV heads (the sample model's 2)")
    parser.add_argument("--q-heads", type=int, default=8, help="query heads (the sample model's 8)")
    parser.add_argument("--head-dim", type=int, default=32, help="head dimension (the sample model's 32)")
    parser.add_argument("--calls", type=int, default=200, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (the fastest is reported)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    heads, q_heads, dim, n = args.kv_heads, args.q_heads, args.head_dim, args.length
    info = ModelInfo(num_layers=32, num_q_heads=q_heads, num_kv_heads=heads, head_dim=dim, hidden_size=q_heads * dim)
    selector = QuestSelector(info, budget=args.budget)
    wide = selector.widened(args.hints) if args.hints else None
    print(f"Quest {args.budget:.0%} (+{args.hints:.0%} hints), {n} tokens, {q_heads}/{heads} heads, d={dim}, 1 thread")
    print(f"{'batch':>5} {'select us':>10} {'/member':>8} {'widened us':>11} {'/member':>8}")
    for batch in (int(b) for b in args.batches.split(",")):
        metadata = [
            selector.build_metadata(PrefillLayer(5, torch.randn(q_heads, n, dim), torch.randn(heads, n, dim), None))
            for _ in range(batch)
        ]
        step = StepQuery(5, torch.randn(batch, q_heads, dim), None, torch.full((batch,), n), [n] * batch)
        plain = _best_us(lambda s=step, m=metadata: selector.select(s, m), args.calls, args.rounds)
        if wide is None:
            both = plain
        else:
            both = _best_us(lambda s=step, m=metadata: selector.select_with_next(s, m, wide), args.calls, args.rounds)
        print(f"{batch:>5} {plain:>10.0f} {plain / batch:>8.0f} {both:>11.0f} {both / batch:>8.0f}")


if __name__ == "__main__":
    main()
