"""A multi-turn chat over real nodes with the prefix caches off and on: per turn, TTFT, TTST, TBT and KV moved.

    .venv/bin/python bench/multi_turn.py [--turns 4] [--link-gbps 0.05] [--schemes full,smartgen]

Each turn sends the whole conversation again as text (what a chat client does): the first turn a
long document and a question, each later turn the previous prompt, the answer and a new question.
With the caches on, the prefill node computes only the new part of each turn and the decode node
already holds the old part's KV (both counted in `usage`), so only the new part crosses the link.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from smartgen.apps.cluster import ClusterSpec, LocalCluster, post_json

SAMPLE = Path(__file__).resolve().parent.parent / "samples" / "sample-model"
CALIBRATION = SAMPLE.parent / "calibration.jsonl"
QUESTIONS = [
    " Question: what is the pass key? Answer:",
    " Question: say the pass key once more. Answer:",
    " Question: which number was buried in the text? Answer:",
    " Question: repeat the secret number. Answer:",
    " Question: what was the number to keep in mind? Answer:",
]
PATHS = ("full", "proactive", "on_demand", "speculative")


def _document(min_chars: int) -> str:
    text = ""
    for line in CALIBRATION.read_text().splitlines():
        text += json.loads(line)["prompt"] + "\n"
        if len(text) >= min_chars:
            break
    return text[:min_chars]


def _moved(cluster: LocalCluster) -> int:
    return sum(node["paths"]["bytes"].get(p, 0) for node in cluster.status()["prefill"] for p in PATHS)


def _settle(cluster: LocalCluster) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(n["requests_held"] for n in cluster.status()["prefill"]):
        time.sleep(0.05)


def chat(cluster: LocalCluster, scheme: str, turns: int, document: str, tokens: int) -> list[dict]:
    rows = []
    prompt = document
    for turn in range(turns):
        prompt += QUESTIONS[turn % len(QUESTIONS)]
        before = _moved(cluster)
        body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "scheme": scheme}
        answer = post_json(f"{cluster.url}/v1/completions", body)
        _settle(cluster)  # late speculative pushes belong to this turn
        usage = answer["usage"]
        rows.append(
            {
                "turn": turn + 1,
                "prompt": usage["prompt_tokens"],
                "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                "held": usage.get("held_tokens", 0),
                "ttft": usage["ttft"],
                "ttst": usage["ttst"],
                "tbt": usage["tbt"],
                "mib": (_moved(cluster) - before) / 2**20,
            }
        )
        prompt += answer["choices"][0]["text"] + "\n"
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--link-gbps", type=float, default=0.05)
    parser.add_argument("--schemes", default="full,smartgen")
    parser.add_argument("--document-chars", type=int, default=6000)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    print(f"sample model, link {args.link_gbps * 1e3:g} Mbit/s, {args.turns} turns, {args.tokens} tokens per answer")
    print(
        f"{'scheme':<9} {'cache':<5} {'turn':>4} {'prompt':>6} {'cached':>6} {'held':>5} "
        f"{'TTFT ms':>8} {'TTST ms':>8} {'TBT ms':>7} {'KV MiB':>7}"
    )
    for cache in ("0", "1G"):
        spec = ClusterSpec(model=SAMPLE, link_gbps=args.link_gbps, blocks=256, prefill_cache=cache, decode_cache=cache)
        with LocalCluster(spec) as cluster:
            post_json(f"{cluster.url}/v1/completions", {"prompt": "warm up", "max_tokens": 2})
            for scheme in args.schemes.split(","):
                # each scheme starts its own conversation: a cache warmed by another scheme's would flatter it
                document = f"[conversation with {scheme}]\n" + _document(args.document_chars)
                for row in chat(cluster, scheme, args.turns, document, args.tokens):
                    print(
                        f"{scheme:<9} {'on' if cache != '0' else 'off':<5} {row['turn']:>4} {row['prompt']:>6} "
                        f"{row['cached']:>6} {row['held']:>5} {row['ttft'] * 1e3:>8.0f} {row['ttst'] * 1e3:>8.0f} "
                        f"{row['tbt'] * 1e3:>7.1f} {row['mib']:>7.2f}"
                    )


if __name__ == "__main__":
    main()
