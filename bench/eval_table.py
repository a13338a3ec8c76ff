"""Merges `smartgen eval --json` reports (e.g. one per length) into the markdown table of docs/selectors.md.

    python bench/eval_table.py main-1024.json main-2048.json main-3072.json po-*.json > table.md

One row per run label (scheme, selector, budget): accuracy % per prompt length with its 95% Wilson
interval, over all prompts, relative to the full cache, and the oracle-recall figures of the run
(top-k recall, retrieval heads' mass kept and top-1 kept; means over the reports, weighted by their
traced prompts). Runs of the same label in several reports are pooled sample by sample.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from smartgen.apps.evaluation import wilson_interval


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path)
    args = parser.parse_args()
    samples: dict[str, list[dict]] = defaultdict(list)
    recalls: dict[str, list[dict]] = defaultdict(list)
    shares: dict[str, list[float]] = defaultdict(list)
    for path in args.reports:
        for label, run in json.loads(path.read_text())["runs"].items():
            samples[label] += run["samples"]
            if run.get("oracle_recall"):
                recalls[label].append(run["oracle_recall"])
            if run.get("proactive_share") is not None:
                shares[label].append(run["proactive_share"])
    lengths = sorted({s["length"] for runs in samples.values() for s in runs})
    reference = samples.get("full-cache")
    ref_mean = sum(s["score"] for s in reference) / len(reference) if reference else None
    head = ["scheme / selector", *(f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths), "all", "rel."]
    head += ["K_r", "top-k recall", "ret. mass", "ret. top-1"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for label, runs in samples.items():
        row = [label]
        for n in lengths:
            scores = [s["score"] for s in runs if s["length"] == n]
            row.append(_cell(scores))
        mean = sum(s["score"] for s in runs) / len(runs)
        row += [_cell([s["score"] for s in runs]), f"{mean / ref_mean:.0%}" if ref_mean else "-"]
        row.append(f"{sum(shares[label]) / len(shares[label]):.0%}" if shares[label] else "-")
        for key in ("recall", "retrieval_mass", "retrieval_top1"):
            row.append(_weighted(recalls[label], key))
        print("| " + " | ".join(row) + " |")
    per_cell = sorted({sum(1 for s in runs if s["length"] == n) for runs in samples.values() for n in lengths})
    traced = sorted({r["prompts"] for rs in recalls.values() for r in rs})
    print(f"\nprompts per length and run: {per_cell}; traced prompts per report for recall: {traced}")


def _cell(scores: list[float]) -> str:
    if not scores:
        return "-"
    mean = sum(scores) / len(scores)
    low, high = wilson_interval(mean, len(scores))
    return f"{100 * mean:.0f} [{100 * low:.0f}–{100 * high:.0f}]"


def _weighted(recalls: list[dict], key: str) -> str:
    pairs = [(r[key], r["prompts"]) for r in recalls if r.get(key) is not None]
    if not pairs:
        return "-"
    return f"{sum(v * w for v, w in pairs) / sum(w for _, w in pairs):.2f}"


if __name__ == "__main__":
    main()
