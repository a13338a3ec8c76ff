"""How well the prompt's last query predicts what Quest picks at the first decode step (the "query" strategy's bet).

    python bench/step_one_prediction.py --model samples/sample-model-16 --length 2048 --prompts 2

For each prompt (passkey and single-needle tasks of the eval suite) and layer >= 2: Quest's picks at the first
decode step, against (a) Quest run with the last prompt position's query, (b) the tokens the last query attends
to most (max over heads; as many tokens as (a) picks). Prints the share of step one's (token, head) picks each
covers. Counts only.
"""

from __future__ import annotations

import argparse

import torch
from hint_coverage import chosen_rows
from transformers import AutoTokenizer

from smartgen.apps.evalsuite.tasks import generate_suite
from smartgen.apps.selector_recall import FIRST_SCORED_LAYER, trace_decode
from smartgen.runtime.models import load_model, model_info
from smartgen.selectors.base import PrefillLayer, StepQuery
from smartgen.selectors.quest import QuestSelector


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="samples/sample-model-16")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per task")
    parser.add_argument("--budget", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=4242)
    args = parser.parse_args()

    model = load_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    info = model_info(model)
    quest = QuestSelector(info, budget=args.budget)
    by_quest = by_attention = total = 0
    for sample in generate_suite(["niah_single", "passkey"], [args.length], args.prompts, args.seed, tokenizer):
        ids = tokenizer(sample.prompt)["input_ids"]
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=2,
            min_new_tokens=2,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        trace = trace_decode(model, ids, out[0, len(ids) :])
        n, heads = trace.prompt_length, info.num_kv_heads
        for layer in [layer for layer in sorted(trace.queries) if layer >= FIRST_SCORED_LAYER]:
            prefill = PrefillLayer(
                layer, trace.queries[layer][:, :n], trace.keys[layer][:, :n], trace.hidden[layer][:n]
            )
            meta = quest.build_metadata(prefill)

            step_one, last = (
                chosen_rows(
                    quest.select(
                        StepQuery(layer, trace.queries[layer][:, p][None], None, torch.tensor([p]), [n]), [meta]
                    ).cpu(),
                    heads,
                    n,
                )
                for p in (trace.steps[0], n - 1)
            )
            query, keys = trace.queries[layer][:, n - 1], trace.keys[layer][:, :n]
            group = query.shape[0] // keys.shape[0]
            logits = torch.einsum("hd,hnd->hn", query, keys.repeat_interleave(group, 0)) * trace.scale
            attention = torch.softmax(logits, -1).amax(0)
            top = torch.zeros(n, dtype=torch.bool)
            top[attention.topk(int(last.any(0).sum())).indices] = True
            by_quest += int((step_one & last).sum())
            by_attention += int((step_one & top[None]).sum())
            total += int(step_one.sum())
    print(f"Quest {args.budget:g}, prompts of {args.length} tokens: of step one's picks,")
    print(f"  Quest with the last prompt query picks {by_quest / total:.2f}")
    print(f"  the last query's most attended tokens (as many) cover {by_attention / total:.2f}")


if __name__ == "__main__":
    main()
