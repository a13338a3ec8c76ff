"""`smartgen eval` at the issue-16 scale (slow): 20 prompts per cell on the sample model, intervals and oracle recall.

Accuracy targets are reported (docs/selectors.md), never asserted: what is checked is that every cell
holds 20 prompts with its Wilson interval, that K_r follows the stall ratio (proactive-only really
drops layers 2-5 on the 6-layer model), and that recall is measured beside accuracy.
"""

from pathlib import Path

import pytest

from smartgen.apps.evalsuite import generate_suite
from smartgen.apps.evaluation import Condition, evaluate_conditions, wilson_interval
from smartgen.runtime.models import load_model

MODEL_DIR = Path(__file__).resolve().parents[1] / "samples" / "sample-model"
PER_CELL = 20


@pytest.mark.slow
def test_twenty_prompts_per_cell_with_intervals_recall_and_the_stall_ratio():
    from transformers import AutoTokenizer

    model = load_model(MODEL_DIR)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)
    samples = generate_suite(["passkey", "niah_single"], [512], PER_CELL, 40_000, tokenizer)
    conditions = [
        Condition("full-cache"),
        Condition("smartgen", "topk", 0.1),
        Condition("smartgen", "quest", 0.1),
        Condition("proactive-only", "topk", 0.1),
    ]
    report = evaluate_conditions(model, tokenizer, samples, conditions, recall_prompts=2, batch_size=8)
    for run in report.runs.values():
        assert len(run.results) == 2 * PER_CELL
        intervals = run.intervals()
        for cell, accuracy in run.accuracy().items():
            assert sum(r.task == cell[0] for r in run.results) == PER_CELL
            low, high = intervals[cell]
            assert (low, high) == wilson_interval(accuracy, PER_CELL) and low <= accuracy <= high
    dropped = report.runs["proactive-only topk 10%"]
    # 6 layers, stall ratio 4.7: K_r = (5/6)/4.7 of the blocks < the floor 2/6, so only layers 0-1 go
    assert dropped.proactive_share == pytest.approx(2 / 6)
    assert dropped.recall is not None and dropped.recall["recall"] == 0.0
    assert all(r.fetched_tokens == 0 for r in dropped.results)
    oracle = report.runs["smartgen topk 10%"].recall
    assert oracle is not None and oracle["recall"] == pytest.approx(1.0) and oracle["prompts"] == 4
    assert oracle["retrieval_heads"], "the sample model's retrieval heads put >= 10% of their weight on the needle"
    quest = report.runs["smartgen quest 10%"].recall
    assert quest is not None and 0 < quest["recall"] < 1 and quest["retrieval_heads"] == oracle["retrieval_heads"]
    assert sum(r.fetched_tokens for r in report.runs["smartgen topk 10%"].results) > 0  # layers >= 2 fetched
