"""The bench's streaming client against AIPerf on one `serve --role both` node: the same prompts, one at a time.

    .venv/bin/python bench/outside_client.py [--requests 20] [--rounds 2] [--aiperf PATH]

AIPerf is not a SmartGen dependency: install it into a venv of its own first (docs/bench.md, "An outside load
generator"): `python3 -m venv ~/.cache/smartgen/aiperf-venv && ~/.cache/smartgen/aiperf-venv/bin/pip install aiperf`.
Each round AIPerf sends `--requests` synthetic prompts of 512 tokens for 16 output tokens at concurrency 1, then the
bench's client (smartgen/apps/bench/client.py) sends AIPerf's own prompts the same way. Both clients' TTFT is also
set against the node's own clock for the same requests (the bench's from usage; AIPerf's from the node's /status
"recent"), which takes the shared machine's drift out: client - node is what each client adds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

from smartgen.apps.bench.client import stream_completion
from smartgen.apps.bench.goodput import SLOs, serve_metrics
from smartgen.apps.bench.models import SAMPLE_MODEL
from smartgen.apps.bench.stats import percentile
from smartgen.apps.cluster import ClusterSpec, LocalCluster, get_json

ISL, OSL = 512, 16
AIPERF = Path.home() / ".cache" / "smartgen" / "aiperf-venv" / "bin" / "aiperf"
# AIPerf's names -> what the bench calls the same figure
AIPERF_METRICS = {
    "time_to_first_token": "TTFT",
    "time_to_second_token": "gap to 2nd token",
    "inter_token_latency": "TPOT",
    "inter_chunk_latency": "ITL",
    "request_latency": "E2E",
}


def line(name: str, values_ms: dict[str, float]) -> str:
    return f"  {name:<40} mean {values_ms['mean']:7.1f}  p50 {values_ms['p50']:7.1f}  p99 {values_ms['p99']:7.1f} ms"


def spread_ms(values: list[float]) -> dict[str, float]:
    return {
        "mean": 1e3 * sum(values) / len(values),
        "p50": 1e3 * (percentile(values, 50) or 0.0),
        "p99": 1e3 * (percentile(values, 99) or 0.0),
    }


def run_aiperf(aiperf: Path, url: str, model: str, requests: int, out: Path) -> list[float]:
    """Runs AIPerf, prints its figures; returns its per-request TTFTs (s) in the order it sent them."""
    command = [str(aiperf), "profile", "--model", model, "--url", url, "--endpoint-type", "completions"]
    command += ["--streaming", "--tokenizer", str(SAMPLE_MODEL), "--isl", str(ISL), "--osl", str(OSL)]
    command += ["--synthetic-input-tokens-stddev", "0", "--output-tokens-stddev", "0"]
    command += ["--extra-inputs", "ignore_eos:true", "--use-legacy-max-tokens", "--use-server-token-count"]
    command += ["--request-count", str(requests), "--concurrency", "1", "--random-seed", "0", "--ui", "none"]
    done = subprocess.run([*command, "--artifact-dir", str(out)], capture_output=True, text=True, timeout=900)
    if done.returncode:
        sys.exit(f"aiperf failed ({done.returncode}): {done.stderr[-2000:]}")
    data = json.loads((out / "profile_export_aiperf.json").read_text())
    for key, name in AIPERF_METRICS.items():
        print(line(f"{name} ({key})", {"mean": data[key]["avg"], "p50": data[key]["p50"], "p99": data[key]["p99"]}))
    records = [json.loads(row) for row in (out / "profile_export.jsonl").read_text().splitlines()]
    records.sort(key=lambda r: r["metadata"]["request_start_ns"])
    return [r["metrics"]["time_to_first_token"]["value"] / 1e3 for r in records]


def run_bench_client(url: str, prompts: list[str]) -> None:
    records = []
    started = time.monotonic()
    for prompt in prompts:
        body = {"prompt": prompt, "max_tokens": OSL, "temperature": 0, "ignore_eos": True}
        records.append({**stream_completion(url, body).record(), "outcome": "served"})
    metrics = serve_metrics(records, time.monotonic() - started, SLOs())
    for key in ("ttft", "tpot", "itl", "e2e"):
        stats = metrics.latencies[key]
        print(line(key.upper(), {k: 1e3 * (stats[k] or 0.0) for k in ("mean", "p50", "p99")}))
    print(line("TTFT - node's", spread_ms([r["ttft"] - r["node_ttft"] for r in records])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--aiperf", type=Path, default=AIPERF)
    args = parser.parse_args()
    if not args.aiperf.exists():
        sys.exit(f"no AIPerf at {args.aiperf}: install it into a venv of its own (this file's docstring)")
    spec = ClusterSpec(model=SAMPLE_MODEL, lane="inproc", blocks=64, max_batch=4, max_tokens=2048)
    with LocalCluster(spec) as cluster, TemporaryDirectory() as tmp:
        model = get_json(f"{cluster.url}/v1/models")["data"][0]["id"]
        stream_completion(cluster.url, {"prompt": [5] * ISL, "max_tokens": 4, "ignore_eos": True})  # warm-up
        for rep in range(args.rounds):
            out = Path(tmp) / f"round{rep}"
            print(f"round {rep}: AIPerf, {args.requests} requests")
            ttfts = run_aiperf(args.aiperf, cluster.url, model, args.requests, out)
            recent = get_json(f"{cluster.url}/status")["recent"][-len(ttfts) :]
            print(line("TTFT - node's", spread_ms([t - float(r["ttft"]) for t, r in zip(ttfts, recent)])))
            inputs = json.loads((out / "inputs.json").read_text())["data"]
            prompts = [session["payloads"][0]["prompt"] for session in inputs]
            print(f"round {rep}: the bench's client, AIPerf's {len(prompts)} prompts")
            run_bench_client(cluster.url, prompts)


if __name__ == "__main__":
    main()
