"""Decode step time of the SmartGen runtime next to Hugging Face's own decode step, as ratios.

    .venv/bin/python bench/decode_step.py                 # 1K, 2K, 4K, 8K; dense all-local and Quest 10% at each
    .venv/bin/python bench/decode_step.py --lengths 1024  # one length

SmartGen runs with every KV block local (full transfer finished), so this measures the
runtime itself: the attention hook, index building, split/gather and sparse attention.
Goals (issue 3): dense <= 1.2x HF; Quest at 10% faster than dense at 8K.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig

from smartgen.engine.policy import get_policy
from smartgen.runtime.models import model_from_config
from smartgen.runtime.pipeline import InprocPipeline


def _median_ms(fn, repeat: int) -> float:
    fn()
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e3


def hf_step_ms(model, prompt: torch.Tensor, repeat: int) -> float:
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=prompt[None], cache=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        position = [prompt.numel()]

        def step() -> None:
            nonlocal token
            # the context grows by one token a step on both sides, as in real decoding
            result = model(
                input_ids=token, cache=cache, use_cache=True, position_ids=torch.tensor([position]), logits_to_keep=1
            )
            position[0] += 1
            token = result.logits[:, -1].argmax(-1, keepdim=True)

        return _median_ms(step, repeat)


def smartgen_step_ms(model, prompt: torch.Tensor, selector: str, params: dict, repeat: int) -> float:
    with InprocPipeline(
        model,
        get_policy("full"),
        selector,
        params,
        num_blocks=1024,
        max_batch=1,
        max_tokens=prompt.numel() + repeat + 4,
    ) as pipeline:
        batch, _ = pipeline.prepare([prompt], max_new_tokens=repeat + 2)

        def step() -> None:
            tokens, _ = pipeline.decode_runner.step(batch)
            batch.advance(tokens)

        ms = _median_ms(step, repeat)
        pipeline.release(batch.request_ids)
        return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192", help="context lengths, comma-separated")
    parser.add_argument("--repeat", type=int, default=9, help="timed steps per case (median reported)")
    parser.add_argument("--budget", type=float, default=0.1, help="Quest token budget as a share of the prompt")
    parser.add_argument(
        "--kv-heads", type=int, default=8, help="KV heads (8 like Llama-3-8B; the query heads are twice as many)"
    )
    parser.add_argument("--head-dim", type=int, default=128, help="head dimension (128 like Llama-3-8B)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (layers 0-1 are always dense)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    # A tiny model (small hidden size) with a real model's KV shape per layer, so attention
    # reads as many bytes per token as it would in Llama-3-8B.
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=args.layers,
        num_attention_heads=2 * args.kv_heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=16384,
    )
    model = model_from_config(config)
    print(
        f"Llama {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {args.layers} layers, "
        f"{2 * args.kv_heads}/{args.kv_heads} heads, d={args.head_dim}, fp32, "
        f"{torch.get_num_threads()} threads, median of {args.repeat} steps"
    )
    print(f"{'context':>8} {'HF ms':>8} {'dense ms':>9} {'dense/HF':>9} {'quest ms':>9} {'quest/dense':>12}")
    for length in (int(x) for x in args.lengths.split(",")):
        prompt = torch.randint(0, 1024, (length,), generator=torch.Generator().manual_seed(0))
        hf = hf_step_ms(model, prompt, args.repeat)
        dense = smartgen_step_ms(model, prompt, "dense", {}, args.repeat)
        quest = smartgen_step_ms(model, prompt, "quest", {"budget": args.budget}, args.repeat)
        print(f"{length:>8} {hf:>8.2f} {dense:>9.2f} {dense / hf:>9.2f} {quest:>9.2f} {quest / dense:>12.2f}")


if __name__ == "__main__":
    main()
