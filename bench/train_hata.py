"""Trains HATA hash weights for a model on a calibration set (JSONL prompts) and writes them as safetensors.

    python bench/train_hata.py                                  # the sample model on samples/calibration.jsonl
    python bench/train_hata.py --model M --calibration C.jsonl --out w.safetensors --rbit 128 --steps 300

The weights go to `smartgen eval --hata-weights` and `bench/selector_recall.py --hata-weights`.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "samples" / "sample-model")
    parser.add_argument("--calibration", type=Path, default=ROOT / "samples" / "calibration.jsonl")
    parser.add_argument("--out", type=Path, help="default: <model>/hata_weights.safetensors")
    parser.add_argument("--prompts", type=int, default=24, help="calibration prompts used (the first N)")
    parser.add_argument("--rbit", type=int, default=128)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(min(2, torch.get_num_threads()))

    from transformers import AutoTokenizer

    from smartgen.apps.profiling import load_calibration
    from smartgen.runtime.models import load_model, model_info
    from smartgen.runtime.prefill import capture_qk
    from smartgen.selectors.hata import save_weights
    from smartgen.selectors.hata_train import HashTrainingConfig, train_hash_weights

    model = load_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    prompts = load_calibration(args.calibration).prompts[: args.prompts]
    start = time.monotonic()
    captured = (capture_qk(model, tokenizer(p)["input_ids"] if isinstance(p, str) else list(p)) for p in prompts)
    config = HashTrainingConfig(rbit=args.rbit, steps=args.steps, seed=args.seed)
    weights = train_hash_weights(
        model_info(model),
        captured,
        config,
        on_progress=lambda layer, loss: print(f"layer {layer}: loss {loss:.3f} ({time.monotonic() - start:.0f} s)"),
    )
    out = args.out or args.model / "hata_weights.safetensors"
    save_weights(weights, out)
    print(f"{len(prompts)} prompts of {args.calibration.name}, rbit {args.rbit}, {args.steps} steps: wrote {out}")


if __name__ == "__main__":
    main()
