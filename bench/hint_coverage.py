"""How much of what later decode steps must fetch a wider selection, pushed ahead, would have brought (hints).

    python bench/hint_coverage.py --model samples/sample-model-16 --length 2048 --steps 32 --prompts 2

For each prompt (passkey and single-needle tasks of the eval suite), the model continues greedily for
--steps tokens; the trace is replayed with Quest at the base budget and at wider ones. Step 0's selection is
taken as local (fetched), then for each later step: the entries its base selection needs that are not yet
local (what it would fetch), and with hints, the same when everything the wider selection ranked at earlier
steps is local too (pushed ahead), with the extra entries those hints moved. No link, no timing: counts only.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoTokenizer

from smartgen.apps.evalsuite.tasks import generate_suite
from smartgen.apps.selector_recall import FIRST_SCORED_LAYER, trace_decode
from smartgen.runtime.models import load_model, model_info
from smartgen.selectors.base import PrefillLayer, StepQuery
from smartgen.selectors.quest import QuestSelector


def chosen_rows(index: torch.Tensor, heads: int, length: int) -> torch.Tensor:
    """[H, k] positions (-1 padding) -> [H, n] bool."""
    chosen = torch.zeros(heads, length, dtype=torch.bool)
    for h in range(heads):
        row = index[h]
        chosen[h, row[row >= 0]] = True
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="samples/sample-model-16")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per task")
    parser.add_argument("--budget", type=float, default=0.1)
    parser.add_argument("--hints", default="0.2,0.5,1.0", help="hint ratios: wider budget = budget x (1 + ratio)")
    parser.add_argument("--seed", type=int, default=777)
    args = parser.parse_args()

    model = load_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    info = model_info(model)
    budgets = [args.budget] + [args.budget * (1 + float(r)) for r in args.hints.split(",")]
    totals = {b: [0, 0] for b in budgets}  # entries fetched after step 0, entries hints pushed
    samples = generate_suite(["passkey", "niah_single"], [args.length], args.prompts, args.seed, tokenizer)
    for sample in samples:
        ids = tokenizer(sample.prompt)["input_ids"]
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=args.steps,
            min_new_tokens=args.steps,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        trace = trace_decode(model, ids, out[0, len(ids) :])
        n = trace.prompt_length
        layers = [layer for layer in sorted(trace.queries) if layer >= FIRST_SCORED_LAYER]
        picks: dict[tuple[float, int, int], torch.Tensor] = {}
        for budget in budgets:
            quest = QuestSelector(info, budget=budget)
            for layer in layers:
                prefill = PrefillLayer(
                    layer, trace.queries[layer][:, :n], trace.keys[layer][:, :n], trace.hidden[layer][:n]
                )
                meta = quest.build_metadata(prefill)
                for t, position in enumerate(trace.steps):
                    step = StepQuery(
                        layer, trace.queries[layer][:, position][None], None, torch.tensor([position]), [n]
                    )
                    picks[(budget, layer, t)] = chosen_rows(quest.select(step, [meta]).cpu(), info.num_kv_heads, n)
        for budget in budgets:
            for layer in layers:
                local = picks[(args.budget, layer, 0)] | picks[(budget, layer, 0)]
                for t in range(1, len(trace.steps)):
                    need, wide = picks[(args.budget, layer, t)], picks[(budget, layer, t)]
                    totals[budget][0] += int((need & ~local).sum())
                    totals[budget][1] += int((wide & ~local & ~need).sum())
                    local |= need | wide
        print(f"{sample.task}: {totals[args.budget][0]} entries fetched without hints so far", flush=True)
    base = totals[args.budget][0]
    print(f"Quest {args.budget:g}, {len(samples)} prompts of {args.length} tokens, {args.steps} steps")
    print("wider budget   fetched later (x no hints)   pushed by hints (x no-hint fetches)")
    for budget in budgets:
        fetched, pushed = totals[budget]
        print(f"{budget:>12.3f}   {fetched:>10d} ({fetched / base:.2f})       {pushed:>10d} ({pushed / base:.2f})")


if __name__ == "__main__":
    main()
