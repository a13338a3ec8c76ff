"""How much of step one's Quest picks a proactive set of whole blocks or of (block, KV head) units covers, at equal bytes.

    python bench/proactive_units.py --model samples/sample-model-16 --length 2048 --fractions 0.0625
    python bench/proactive_units.py --model ~/.cache/smartgen/bench-models/random-L32-seed0 --fractions 0.134

A profile is made as `smartgen profile` makes one (calibration prompts of length/2 to 2·length tokens from
samples/calibration.jsonl, greedy continuations, Quest's picks counted per layer, KV head and relative block),
but kept per head as well. Then for each test prompt (passkey and single-needle tasks of the eval suite) and a
proactive byte budget (a fraction of the KV), four sets over layers >= 2, best first until the bytes are spent:
- block: whole blocks (every KV head of a token range) by the block profile (today's proactive set);
- head: (block, KV head) units by the per-head profile;
- oracle block / oracle head: the same units ranked by this prompt's own step-one picks per byte.
Prints the share of step one's (token, head) picks each set holds. Counts only, no link, no timing.
The fractions the bench's regime gives (stall 4.7): about 0.0625 on 16 layers, 0.134 on 32 (docs/results/2026-12-02-per-head-units-decode-cpu.md).
"""

from __future__ import annotations

import argparse

import torch
from hint_coverage import chosen_rows  # bench/hint_coverage.py, beside this script
from transformers import AutoTokenizer

from smartgen.apps.evalsuite.tasks import generate_suite
from smartgen.apps.profiling import load_calibration
from smartgen.apps.selector_recall import FIRST_SCORED_LAYER, trace_decode
from smartgen.runtime.models import load_model, model_info
from smartgen.selectors.base import PrefillLayer, StepQuery
from smartgen.selectors.quest import QuestSelector
from smartgen.sysinfo import SAMPLES_DIR

SETS = ("block", "head", "oracle block", "oracle head")


class Picker:
    """Quest's picks [H, n] per layer and decode step of a greedy continuation."""

    def __init__(self, model_path: str, budget: float) -> None:
        self.model = load_model(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self.info = model_info(self.model)
        self.quest = QuestSelector(self.info, budget=budget)

    def picks(self, ids: list[int], steps: int) -> tuple[int, dict[int, list[torch.Tensor]]]:
        out = self.model.generate(
            torch.tensor([ids]),
            max_new_tokens=steps + 1,  # the first token comes from prefill; steps start at the second
            min_new_tokens=steps + 1,
            do_sample=False,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        trace = trace_decode(self.model, ids, out[0, len(ids) :])
        n, heads = trace.prompt_length, self.info.num_kv_heads
        result = {}
        for layer in sorted(layer for layer in trace.queries if layer >= FIRST_SCORED_LAYER):
            q, k = trace.queries[layer], trace.keys[layer]
            meta = self.quest.build_metadata(PrefillLayer(layer, q[:, :n], k[:, :n], trace.hidden[layer][:n]))
            result[layer] = [
                chosen_rows(
                    self.quest.select(StepQuery(layer, q[:, p][None], None, torch.tensor([p]), [n]), [meta]).cpu(),
                    heads,
                    n,
                )
                for p in trace.steps[:steps]
            ]
        return n, result


def _blocks(n: int, num_blocks: int) -> torch.Tensor:
    return torch.arange(n) * num_blocks // n  # block m covers tokens [floor(m·n/M), floor((m+1)·n/M))


def calibrate(picker: Picker, length: int, prompts: int, steps: int, num_blocks: int) -> torch.Tensor:
    """Per-head importance [L, H, M]: mean selection count of a block's entries, summed over prompts."""
    info = picker.info
    importance = torch.zeros(info.num_layers, info.num_kv_heads, num_blocks)
    used = 0
    for text in load_calibration(SAMPLES_DIR / "calibration.jsonl").prompts:
        ids = picker.tokenizer(text)["input_ids"]
        if len(ids) < length // 2:
            continue
        n, result = picker.picks(ids[: length * 2], steps)
        blocks = _blocks(n, num_blocks)
        sizes = torch.zeros(num_blocks).index_add_(0, blocks, torch.ones(n)).clamp(min=1)
        for layer, per_step in result.items():
            counts = torch.stack(per_step).float().sum(0)  # [H, n]
            importance[layer] += torch.zeros_like(importance[layer]).index_add_(1, blocks, counts) / sizes
        used += 1
        if used == prompts:
            break
    print(f"profile: {used} calibration prompts, {steps} steps each")
    return importance


def _take(score: torch.Tensor, cost: torch.Tensor, hits: torch.Tensor, budget: float) -> int:
    """Step-one picks held by the best-scored units whose cumulative cost fits the budget."""
    order = torch.argsort(score.flatten(), descending=True, stable=True)
    fits = int((cost.flatten()[order].cumsum(0) <= budget).sum())
    return int(hits.flatten()[order[:fits]].sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(SAMPLES_DIR / "sample-model-16"))
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--calibration-prompts", type=int, default=8)
    parser.add_argument("--calibration-steps", type=int, default=8, help="decode steps counted per prompt")
    parser.add_argument("--prompts", type=int, default=2, help="test prompts per task")
    parser.add_argument("--budget", type=float, default=0.1, help="Quest's selection budget")
    parser.add_argument("--blocks", type=int, default=1024, help="M")
    parser.add_argument("--fractions", default="0.0625,0.134", help="proactive bytes as fractions of the KV")
    parser.add_argument("--seed", type=int, default=4242)
    args = parser.parse_args()

    picker = Picker(args.model, args.budget)
    info, num_blocks = picker.info, args.blocks
    layers, heads = info.num_layers, info.num_kv_heads
    importance = calibrate(picker, args.length, args.calibration_prompts, args.calibration_steps, num_blocks)
    fractions = [float(f) for f in args.fractions.split(",")]
    held = {(f, name): 0 for f in fractions for name in SETS}
    total = 0
    samples = generate_suite(["niah_single", "passkey"], [args.length], args.prompts, args.seed, picker.tokenizer)
    for sample in samples:
        n, result = picker.picks(picker.tokenizer(sample.prompt)["input_ids"], 1)
        blocks = _blocks(n, num_blocks)
        step_one = torch.zeros(layers, heads, n)
        for layer, per_step in result.items():
            step_one[layer] = per_step[0].float()
        total += int(step_one.sum())
        sizes = torch.zeros(num_blocks).index_add_(0, blocks, torch.ones(n))
        hits = torch.zeros(layers, heads, num_blocks).index_add_(2, blocks, step_one)  # [L, H, M]
        head_cost = sizes.expand(layers, heads, num_blocks)
        block_cost = (sizes * heads).expand(layers, num_blocks)
        scores = {
            "block": (importance.sum(1), block_cost, hits.sum(1)),
            "head": (importance.clone(), head_cost, hits),
            "oracle block": (hits.sum(1) / block_cost.clamp(min=1), block_cost, hits.sum(1)),
            "oracle head": (hits / head_cost.clamp(min=1), head_cost, hits),
        }
        for score, _, _ in scores.values():
            score[:FIRST_SCORED_LAYER] = -1  # layers 0-1 are pushed whole ahead of any proactive set
        for f in fractions:
            for name, (score, cost, unit_hits) in scores.items():
                held[(f, name)] += _take(score, cost, unit_hits, f * layers * heads * n)
    print(f"Quest {args.budget:g}, {len(samples)} prompts of {args.length} tokens: share of step one's picks held")
    for f in fractions:
        print(f"  proactive bytes {f:.4f} of the KV: " + ", ".join(f"{s} {held[(f, s)] / total:.3f}" for s in SETS))


if __name__ == "__main__":
    main()
