"""Full-cache accuracy of the sample model per task and length, and where its retrieval heads are.

    python samples/evaluate_sample_model.py                         # 10 prompts per cell, 1K-8K
    python samples/evaluate_sample_model.py --lengths 1024 --num 4

Accuracy: greedy decoding on evalsuite "eval" prompts (needles at depths i/(n-1)), each task's own metric.
Retrieval heads: at the answer position (the prompt's last token), the attention weight each head puts on
the answer needle's tokens, averaged over prompts; a layer that retrieves has heads near 1.
Writes <model>/eval_results.json and prints markdown tables for the model card.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from sample_runner import MODEL_DIR, answer, load, needle_mass

from smartgen.apps.evalsuite import TASKS, generate_suite, score_sample


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=MODEL_DIR)
    p.add_argument("--tasks", nargs="+", default=list(TASKS))
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    p.add_argument("--num", type=int, default=10, help="prompts per (task, length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heads-num", type=int, default=4, help="prompts per (task, length) for the head probe (1K, 2K)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model)
    t0 = time.time()
    results: dict[str, dict[str, float]] = {}
    examples: dict[str, list[str]] = {}
    samples = generate_suite(args.tasks, args.lengths, args.num, args.seed, tokenizer, variant="eval")
    for i, sample in enumerate(samples):
        prediction = answer(model, tokenizer, sample)
        cell = results.setdefault(sample.task, {})
        cell.setdefault(str(sample.length), []).append(score_sample(sample, prediction))
        examples.setdefault(f"{sample.task}@{sample.length}", []).append(f"{prediction!r} <- {sample.references}")
        eta = (time.time() - t0) / (i + 1) * (len(samples) - i - 1)
        print(
            f"{i + 1}/{len(samples)} {sample.task}@{sample.length} d={sample.depth:.2f} "
            f"score={cell[str(sample.length)][-1]:.2f} pred={prediction!r} ref={sample.references} ETA {eta / 60:.1f}m",
            flush=True,
        )
    table = {task: {n: sum(v) / len(v) for n, v in cells.items()} for task, cells in results.items()}

    head_samples = generate_suite(
        [t for t in args.tasks if t != "vt"],
        [n for n in args.lengths if n <= 2048],
        args.heads_num,
        args.seed + 500,
        tokenizer,
        variant="eval",
    )
    mass = torch.stack([needle_mass(model, tokenizer, s) for s in head_samples]).mean(0)  # [L, H]
    print("\n| task | " + " | ".join(f"{n // 1024}K" for n in args.lengths) + " |\n|---|" + "---|" * len(args.lengths))
    for task, cells in table.items():
        print(f"| {task} | " + " | ".join(f"{cells[str(n)]:.2f}" for n in args.lengths) + " |")
    print("\n| layer | mean over heads | max head (which) |\n|---|---|---|")
    for layer, row in enumerate(mass):
        print(f"| {layer} | {row.mean():.3f} | {row.max():.3f} (head {int(row.argmax())}) |")
    out = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "accuracy": table,
        "num_per_cell": args.num,
        "needle_mass_per_layer_head": [[round(float(x), 4) for x in row] for row in mass],
        "examples": {k: v[:3] for k, v in examples.items()},
        "seconds": round(time.time() - t0, 1),
    }
    (args.model / "eval_results.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.model / 'eval_results.json'} in {(time.time() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main(sys.argv[1:])
