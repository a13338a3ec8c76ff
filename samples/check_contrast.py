"""The contrast that makes the sample model useful: restricting layers >= 2 to a StreamingLLM window must
hurt, restricting them to the exact top 20% of tokens by attention score must not.

    python samples/check_contrast.py                      # 10 prompts per cell at 1K and 2K (~10 min on 2 cores)
    python samples/check_contrast.py --num 4 --lengths 1024

Conditions, all on evalsuite "eval" prompts with greedy decoding (see sample_attention.py for the protocol):
  full       every layer dense
  streaming  layers >= 2: 4 sink tokens + the most recent 10% of the context
  topk       layers >= 2: the 20% of the context with the highest attention score, per head and row
  streaming_below  the StreamingLLM window on layers 0-1 only (where retrieval must not happen)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from sample_attention import Restriction
from sample_runner import MODEL_DIR, answer, load

from smartgen.apps.evalsuite import generate_suite, score_sample

CONDITIONS = {
    "full": lambda layer: None,
    "streaming": lambda layer: Restriction(mode="streaming", from_layer=layer, sinks=4, recent=0.10),
    "topk": lambda layer: Restriction(mode="topk", from_layer=layer, topk=0.20),
    # the converse: StreamingLLM on the layers SmartGen always sends whole must change little
    "streaming_below": lambda layer: Restriction(
        mode="streaming", from_layer=0, until_layer=layer, sinks=4, recent=0.10
    ),
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=MODEL_DIR)
    p.add_argument("--tasks", nargs="+", default=["passkey", "niah_single", "niah_multikey", "kv_retrieval"])
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048])
    p.add_argument("--num", type=int, default=10, help="prompts per (task, length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--from-layer", type=int, default=2)
    p.add_argument("--decode-tail", type=int, default=32, help="prompt tokens that run restricted, as decode steps")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="JSON results (default: <model>/contrast.json)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model)
    samples = generate_suite(args.tasks, args.lengths, args.num, args.seed, tokenizer, variant="eval")
    scores: dict[str, dict[str, list[float]]] = {c: {} for c in CONDITIONS}
    t0 = time.time()
    for i, sample in enumerate(samples):
        cell = f"{sample.task}@{sample.length}"
        for condition, make in CONDITIONS.items():
            prediction = answer(model, tokenizer, sample, make(args.from_layer), args.decode_tail)
            scores[condition].setdefault(cell, []).append(score_sample(sample, prediction))
        done = i + 1
        eta = (time.time() - t0) / done * (len(samples) - done)
        print(
            f"{done}/{len(samples)} {cell} depth {sample.depth:.2f}: "
            + " ".join(f"{c}={scores[c][cell][-1]:.2f}" for c in CONDITIONS)
            + f"  ETA {eta / 60:.1f}m",
            flush=True,
        )
    table = {c: {cell: sum(v) / len(v) for cell, v in cells.items()} for c, cells in scores.items()}
    overall = {
        c: sum(sum(v) for v in cells.values()) / sum(len(v) for v in cells.values()) for c, cells in scores.items()
    }
    print("\n| cell | " + " | ".join(CONDITIONS) + " |\n|---|" + "---|" * len(CONDITIONS))
    for cell in table["full"]:
        print(f"| {cell} | " + " | ".join(f"{table[c][cell]:.2f}" for c in CONDITIONS) + " |")
    print("| all | " + " | ".join(f"{overall[c]:.2f}" for c in CONDITIONS) + " |")
    result = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "per_cell": table,
        "overall": overall,
        "num_per_cell": args.num,
        "seconds": round(time.time() - t0, 1),
    }
    out = args.out or args.model / "contrast.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
