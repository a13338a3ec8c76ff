"""Write samples/calibration.jsonl: the calibration prompts (evalsuite variant "calibration") at 1K and 2K.

    python samples/make_calibration.py [--num 6] [--seed 1000]

Lengths are in tokens of the sample model's tokenizer (samples/sample-model; the suite's own BPE when the
folder is missing, which is the same tokenizer). The prompts share no template, filler sentence or seed
stream with the evaluation set (tests/test_evalsuite.py checks it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from smartgen.apps.evalsuite import TASKS, generate_suite

ROOT = Path(__file__).resolve().parent


def load_tokenizer():
    model_dir = ROOT / "sample-model"
    if (model_dir / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)
    from smartgen.apps.evalsuite.tokenizer import train_tokenizer

    return train_tokenizer()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num", type=int, default=6, help="prompts per (task, length): 5 tasks x 2 lengths x 6 = 60")
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048])
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--out", type=Path, default=ROOT / "calibration.jsonl")
    args = p.parse_args(argv)
    samples = generate_suite(TASKS, args.lengths, args.num, args.seed, load_tokenizer(), variant="calibration")
    with args.out.open("w") as f:
        for s in samples:
            f.write(json.dumps(s.to_json() | {"num_tokens": s.num_tokens}) + "\n")
    print(f"wrote {len(samples)} prompts to {args.out}")


if __name__ == "__main__":
    main()
