"""Oracle recall of each selector on the sample model: the exact top-k's choice kept, per layer, head and budget.

Each eval-suite prompt is answered densely (greedy), then replayed once with every layer's q/k recorded
(`smartgen.apps.selector_recall`); every selector then picks on every decode step and is compared with the
exact top-k at the same budget. Prints, per selector, budget and length: recall of the oracle's top-k
over all sparse layers and KV heads, attention mass kept (mean over query heads, and the oracle's own),
and on the retrieval heads (full attention puts >= 10% on the answer needle): their recall, mass kept, how
often their most attended token is kept (top1) and needle tokens kept. `--per-head` also prints the [layer x head] recall of every run.

    python bench/selector_recall.py --lengths 1024,2048,3072 --num 4 \\
        --selectors quest,infinigen,streaming --budgets 0.1,0.2
    # a selector's own parameters after a colon, ';' between them:
    python bench/selector_recall.py --selectors 'quest:page_size=4,infinigen:partial_ratio=0.5;speculate=false'
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "samples" / "sample-model")
    parser.add_argument("--selectors", default="quest,infinigen,streaming")
    parser.add_argument("--budgets", default="0.1,0.2")
    parser.add_argument("--tasks", default="passkey,niah_single,niah_multikey")
    parser.add_argument("--lengths", default="1024,2048,3072")
    parser.add_argument("--num", type=int, default=4, help="prompts per task and length")
    parser.add_argument("--seed", type=int, default=7000, help="held out: the repository's runs use 0")
    parser.add_argument("--hata-weights", type=Path, help="HATA hash weights (hata.save_weights) for 'hata'")
    parser.add_argument("--per-head", action="store_true", help="also print recall per layer and head")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(min(2, torch.get_num_threads()))

    from transformers import AutoTokenizer

    from smartgen.apps.evalsuite import generate_suite
    from smartgen.apps.evaluation import infinigen_warmup, parse_selector_spec
    from smartgen.apps.selector_recall import RecallStats, retrieval_heads, selector_recall, trace_sample
    from smartgen.runtime.models import load_model, model_info
    from smartgen.selectors import make_selector

    model = load_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    info = model_info(model)
    tasks = args.tasks.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    budgets = [float(x) for x in args.budgets.split(",")]
    specs = [parse_selector_spec(s) for s in args.selectors.split(",")]
    samples = generate_suite(tasks, lengths, args.num, args.seed, tokenizer, variant="eval")
    extra: dict[str, dict] = {}
    if any(name == "infinigen" for name, _ in specs):
        extra["infinigen"] = {"skew": infinigen_warmup(model, tokenizer, samples)}
    if any(name == "hata" for name, _ in specs):
        from smartgen.selectors.hata import load_weights

        if args.hata_weights is None:
            sys.exit("--hata-weights is needed for the hata selector (train them with bench/train_hata.py)")
        extra["hata"] = {"weights": load_weights(args.hata_weights)}
    runs = {}
    for name, params in specs:
        for budget in budgets:
            label = f"{name}{''.join(f' {k}={v}' for k, v in params.items())} @{budget:g}"
            runs[label] = (make_selector(name, info, budget=budget, **params, **extra.get(name, {})), budget)
    stats: dict[tuple[str, int], RecallStats] = {}
    start = time.monotonic()
    for i, sample in enumerate(samples):
        trace = trace_sample(model, tokenizer, sample)
        for label, (selector, budget) in runs.items():
            key = (label, sample.length)
            stats[key] = selector_recall(selector, budget, trace, stats.get(key))
        print(f"\r{i + 1}/{len(samples)} prompts, {time.monotonic() - start:.0f} s", end="", file=sys.stderr)
    print(file=sys.stderr)
    heads = retrieval_heads(next(iter(stats.values())).merge(stats[(next(iter(runs)), lengths[-1])]))
    print(f"model {args.model.name}; tasks {args.tasks}; {args.num} prompts per task and length; seed {args.seed}")
    print(f"retrieval heads (layer, query head), full attention >= 10% on the needle: {heads}")
    header = f"{'selector':<44}{'len':>6}{'recall':>8}{'mass':>7}{'oracle':>8}{'size':>6}"
    header += f"{'ret.rec':>9}{'ret.mass':>9}{'ret.orc':>8}{'top1':>6}{'needle':>8}"
    print(header)
    for (label, length), s in stats.items():
        line = f"{label:<44}{length:>6}{s.overall('kv_recall'):>8.3f}{s.overall('mass'):>7.3f}"
        line += f"{s.overall('oracle_mass'):>8.3f}{s.overall('size'):>6.2f}"
        if heads:
            line += f"{s.overall('head_recall', heads):>9.3f}{s.overall('mass', heads):>9.3f}"
            line += f"{s.overall('oracle_mass', heads):>8.3f}{s.overall('top1_hit', heads):>6.2f}"
            line += f"{s.overall('needle_hit', heads):>8.3f}"
        print(line)
    if args.per_head:
        for (label, length), s in stats.items():
            print(f"\n{label} @ {length}: head_recall [layer x query head] (layers >= 2)")
            print(s.mean("head_recall")[2:].numpy().round(2))


if __name__ == "__main__":
    main()
